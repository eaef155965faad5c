"""The packages stack in floors, and an import only ever points down (issues 26 and 37):

    spec < impl_numpy, impl_torch, impl_jax < importers, export < conformance < pages, benchmarks < rosetta

and so do the modules inside conformance/, the verdict machinery (CONFORMANCE_FLOORS): a
cell is run below the executors that run it, and they below the reports written of it.

Every import of every module is read from its source (those inside functions too), so a lazy
import cannot hide an arrow up a floor; and no module imports itself back through others.
`from package import name` where name is a submodule counts as an import of that submodule."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FLOORS = {"spec": 0, "impl_numpy": 1, "impl_torch": 1, "impl_jax": 1, "importers": 2, "export": 2, "conformance": 3,
          "pages": 4, "benchmarks": 4, "rosetta": 5}
# conformance/'s own floors, by module (a package's floor is its submodules' too)
CONFORMANCE_FLOORS = {
    "tolerance": 0, "adapter": 0, "machine": 0,  # the policy, the protocol, where a run ran
    "text": 0,  # real text's token ids, the text cases' input
    "diagnosis.field_metrics": 0,  # the field's metrics of a model's output
    "cases": 1,  # the catalogue
    "plan": 2,  # what the catalogue's cells take, in memory and time, and what fits (memory, cost, budget)
    "backends": 2, "byo": 2, "deployment.export_check": 2,  # what runs a case
    "training_cells": 3, "diagnosis.observability": 3, "models": 3,  # what reads the golden or a backend's outputs
    "deployment.quantized_serving": 3,  # who makes and runs a quantized column, and the weights it stores
    "diagnosis.routing": 3,  # a mixture of experts' routing: the golden's margins, replayed in a column
    "cells": 4,  # one cell run and judged
    "executors": 5,  # where cells run
    "harness": 6,  # the matrix planned and handed to an executor
    "diagnosis.localize": 7, "output.report": 7,  # what is made of the results
    "output.shards": 8, "output.terminal": 8,
    "diagnosis.explain": 8,  # a whole-model column's failure explained by omissions, where localize has no layers
    "deployment.quantized": 8,  # a quantized deployment held to the golden on its stored weights; its cost by stage
    "check": 9,  # one whole check
    # a room's package (its __init__, a docstring) imports nothing: the floor of its lowest module
    "diagnosis": 0, "deployment": 2, "output": 7,
}
WHOLE_ROOMS = {"plan", "backends", "executors"}  # packages whose every module shares the package's floor


@dataclass(frozen=True)
class Module:
    name: str  # dotted, e.g. "conformance.output.report"; a package is its __init__
    path: str  # relative to the tree's root, for messages
    source: str
    is_package: bool


@dataclass(frozen=True)
class Arrow:
    importer: str
    imported: str
    where: str  # path:line


def read_tree(root: Path, packages=tuple(FLOORS)) -> dict[str, Module]:
    """Every .py module of the packages under root, by dotted name."""
    modules = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            name = ".".join(parts[:-1] if is_package else parts)
            modules[name] = Module(name, str(path.relative_to(root)), path.read_text(), is_package)
    return modules


def _absolute(module: Module, node: ast.ImportFrom) -> str:
    """The module a `from ... import` names, relative imports resolved."""
    if not node.level:
        return node.module or ""
    package = module.name.split(".") if module.is_package else module.name.split(".")[:-1]
    base = package[:len(package) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def _known(name: str, modules: dict[str, Module]) -> str | None:
    """The project module a dotted name is (or lies in), or None for a name outside the project."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def arrows(modules: dict[str, Module]) -> list[Arrow]:
    """Every import between the project's modules, top-level and inside functions alike."""
    found = []
    for module in modules.values():
        for node in ast.walk(ast.parse(module.source, module.path)):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _absolute(module, node)
                named = [f"{base}.{alias.name}" for alias in node.names]
                targets = [name if name in modules else base for name in named]
            else:
                continue
            for target in targets:
                imported = _known(target, modules)
                if imported is not None and imported != module.name:
                    found.append(Arrow(module.name, imported, f"{module.path}:{node.lineno}"))
    return list(dict.fromkeys(found))  # `from a import b, c` of one module is one arrow


def _floor(name: str) -> int:
    return FLOORS[name.split(".")[0]]


def conformance_floor(name: str) -> int:
    """A conformance module's floor: its own entry in CONFORMANCE_FLOORS (a room's module by its
    dotted name under conformance, e.g. "diagnosis.routing"), or its package's where every module
    of that package shares one floor (WHOLE_ROOMS); KeyError for one neither places."""
    inside = name.split(".", 1)[1]
    if inside in CONFORMANCE_FLOORS:
        return CONFORMANCE_FLOORS[inside]
    if inside.split(".")[0] in WHOLE_ROOMS:
        return CONFORMANCE_FLOORS[inside.split(".")[0]]
    raise KeyError(f"{name}: place it in CONFORMANCE_FLOORS")


def upward_inside_conformance(found: list[Arrow]) -> list[str]:
    """'path:line: a -> b (floor i imports floor j)' for each import of a higher conformance module."""
    inside = [arrow for arrow in found if arrow.importer.startswith("conformance.")
              and arrow.imported.startswith("conformance.")]
    return [f"{arrow.where}: {arrow.importer} -> {arrow.imported} "
            f"(floor {conformance_floor(arrow.importer)} imports floor {conformance_floor(arrow.imported)})"
            for arrow in inside if conformance_floor(arrow.imported) > conformance_floor(arrow.importer)]


def upward(found: list[Arrow]) -> list[str]:
    """'path:line: a -> b (floor i imports floor j)' for each import of a higher package."""
    return [f"{arrow.where}: {arrow.importer} -> {arrow.imported} "
            f"(floor {_floor(arrow.importer)} imports floor {_floor(arrow.imported)})"
            for arrow in found if _floor(arrow.imported) > _floor(arrow.importer)]


def cycles(found: list[Arrow]) -> list[str]:
    """Cycles 'a -> b -> a' among the modules: in each group of modules that import one another
    (Tarjan's strongly connected components), the shortest way round from each module that no
    cycle already shown passes through."""
    graph: dict[str, set[str]] = {}
    for arrow in found:
        graph.setdefault(arrow.importer, set()).add(arrow.imported)
        graph.setdefault(arrow.imported, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for neighbour in sorted(graph[node]):
            if neighbour not in index:
                visit(neighbour)
                low[node] = min(low[node], low[neighbour])
            elif neighbour in stack:
                low[node] = min(low[node], index[neighbour])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    shown = []
    for group in sorted(groups):
        covered: set[str] = set()
        for start in group:
            if start not in covered:
                cycle = _shortest_cycle(graph, start, set(group))
                covered.update(cycle)
                shown.append(" -> ".join(cycle))
    return shown


def _shortest_cycle(graph: dict[str, set[str]], start: str, members: set[str]) -> list[str]:
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for neighbour in sorted(graph[node] & members):
                if neighbour == start:
                    return paths[node] + [start]
                if neighbour not in paths:
                    paths[neighbour] = paths[node] + [neighbour]
                    following.append(neighbour)
        frontier = following
    raise AssertionError(f"no way back to {start} within {sorted(members)}")


# ---- the project ------------------------------------------------------------------------------

PROJECT = read_tree(ROOT)


def test_every_package_is_read():
    assert {name.split(".")[0] for name in PROJECT} == set(FLOORS)
    assert "rosetta.main" in PROJECT and "conformance.output.report" in PROJECT


def test_no_import_points_up_a_floor():
    found = upward(arrows(PROJECT))
    assert not found, "imports of a higher package:\n" + "\n".join(found)


def _placed(name: str) -> bool:
    try:
        conformance_floor(name)
    except KeyError:
        return False
    return True


def test_every_conformance_module_has_a_floor():
    """Every module of conformance/ is placed: by its own name, or as a module of a room whose
    modules share one floor; a module added to a room of mixed floors must be placed itself."""
    unplaced = [name for name in PROJECT if name.startswith("conformance.") and not _placed(name)]
    assert not unplaced, f"place these in CONFORMANCE_FLOORS: {unplaced}"


def test_the_root_of_conformance_holds_the_verdicts_core():
    """conformance/'s root holds at most 15 modules (the verdict's core); the rest live in rooms
    whose names say what they hold (plan, diagnosis, deployment, output, backends, executors)."""
    root = [name for name, module in PROJECT.items() if name.count(".") == 1 and name.startswith("conformance.")
            and not module.is_package]
    assert len(root) + 1 <= 15, sorted(root)  # and its __init__


def test_no_import_points_up_inside_conformance():
    found = upward_inside_conformance(arrows(PROJECT))
    assert not found, "imports of a higher module of conformance/:\n" + "\n".join(found)


def test_no_module_imports_itself_back():
    found = cycles(arrows(PROJECT))
    assert not found, "import cycles:\n" + "\n".join(found)


# ---- the checker can fail ---------------------------------------------------------------------

def test_a_planted_upward_import_and_cycle_are_reported(tmp_path):
    sources = {
        "spec/__init__.py": "",
        "spec/model.py": "import numpy\n\ndef load():\n    from conformance.report import write  # lazy: counted\n",
        "conformance/__init__.py": "",
        "conformance/report.py": "from conformance import tables\n",  # a submodule named by `from package import`
        "conformance/tables.py": "from .report import write\nfrom spec import load\n",  # relative; spec's own name
        "rosetta/__init__.py": "",
        "rosetta/main.py": "from conformance.report import write\n",
    }
    for path, source in sources.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(source)
    found = arrows(read_tree(tmp_path, ("spec", "conformance", "rosetta")))
    assert upward(found) == ["spec/model.py:4: spec.model -> conformance.report (floor 0 imports floor 3)"]
    assert cycles(found) == ["conformance.report -> conformance.tables -> conformance.report"]
    assert Arrow("conformance.tables", "spec", "conformance/tables.py:2") in found


def test_an_executor_importing_the_report_is_reported(tmp_path):
    """The arrow issue 37 removed: an executor (floor 5) that imports the report (floor 7)."""
    sources = {"conformance/__init__.py": "", "conformance/output/report.py": "",
               "conformance/executors/__init__.py": "",
               "conformance/executors/ray_cluster.py": "def where():\n    from conformance.output.report import device_facts\n"}
    for path, source in sources.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(source)
    found = upward_inside_conformance(arrows(read_tree(tmp_path, ("conformance",))))
    assert found == ["conformance/executors/ray_cluster.py:2: conformance.executors.ray_cluster -> conformance.output.report "
                     "(floor 5 imports floor 7)"]
