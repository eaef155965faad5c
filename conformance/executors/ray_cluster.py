"""The Ray executor: columns in Ray actors on the nodes of a cluster (`rosetta check --executor ray`).

One long-lived actor per column group (executors.column_groups: jax and jax-math of a dtype
share one, so they share compiled programs), placed by what its columns need: one CPU for a CPU
column, one GPU for a CUDA column, and with `accelerator` a GPU of that kind (Ray's
`accelerator_type:NAME` resource, which Ray gives a node with such a GPU and `ray start
--resources` can give any node). A group that no live node can hold is reported as skip cells
that say so before anything is submitted: it never waits for a node that does not exist.

The golden's output is computed here, on the driver, and put in the object store once per case
with the case itself; every actor reads it from there. Arrays that come out of the object store
are read-only views of shared memory: an actor copies a case's inputs and the weights before a
backend sees them (a runner may write into what it is given).

Each column records where it ran: the node, its host, the device's name, the driver and the
package versions (placements, written into the report). An actor that dies (a segfault, an
out-of-memory kill) turns the unfinished cells of the column it was running into errors that
quote Ray's exit detail; nothing is retried (at most once), and its group's later columns go
to a new actor. An actor is given one cell at a time, the next once the last one's answer is in
hand: Ray drops the answers a dying worker had not yet sent (under load, all of them), so with
more in flight a crash at one cell would turn cells that had passed before it into errors. Before any column runs, every live node reports the versions of this project,
Python and the frameworks, and a cluster whose nodes differ is refused (ClusterMismatch).
"""

from __future__ import annotations

import os
import socket
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from conformance.adapter import get_backend, register_backend, registered_paths
from conformance.cells import (ABSENT, ERROR, SKIP, CellResult, golden_runner_for, reference_for, run_cell,
                               unavailable_kind)
from conformance.executors import Column, OnResult, WorkItem, column_groups, cost_rank
from spec import ModelConfig


class RayUnavailable(RuntimeError):
    """Ray is not installed, or no cluster could be reached."""


class ClusterMismatch(RuntimeError):
    """The cluster's nodes run different versions of the project, Python or the frameworks."""


def _ray():
    try:
        import ray
    except ImportError:
        raise RayUnavailable("the ray executor needs Ray, which is not installed here: "
                             "pip install '.[ray]' (or -c constraints.txt ray)") from None
    return ray


# ---- pure functions: what a column needs, and whether the cluster has it -----------------

def column_requirement(column: Column, accelerator: str | None = None) -> dict[str, float]:
    """The resources one actor of the column's group asks for."""
    _, _, device = column
    if device == "cpu":
        return {"CPU": 1.0}
    return {"GPU": 1.0, **({f"accelerator_type:{accelerator}": 0.001} if accelerator else {})}


def unplaceable_reason(requirement: Mapping[str, float], nodes: Sequence[Mapping[str, float]]) -> str | None:
    """None where some node's total resources hold the requirement; else why not, in words."""
    if any(all(node.get(name, 0.0) >= amount for name, amount in requirement.items()) for node in nodes):
        return None
    kind = next((name.split(":", 1)[1] for name in requirement if name.startswith("accelerator_type:")), None)
    if kind:
        return f"no node with GPU type {kind} in the Ray cluster"
    if "GPU" in requirement:
        return "no node with a GPU in the Ray cluster"
    return "no node with " + " and ".join(f"{amount:g} {name}" for name, amount in requirement.items())


def cluster_devices(nodes: Sequence[Mapping[str, float]]) -> list[str]:
    """The devices some node of the cluster has: the CPU, and CUDA where a node has a GPU."""
    return ["cpu"] + (["cuda"] if any(node.get("GPU", 0.0) > 0 for node in nodes) else [])


def version_mismatches(fingerprints: Mapping[str, Mapping[str, str | None]]) -> list[str]:
    """Every field on which a node differs from the first node, in words (empty: all agree)."""
    if not fingerprints:
        return []
    (first, reference), *others = fingerprints.items()
    problems = []
    for node, found in others:
        for name in sorted(set(reference) | set(found)):
            if reference.get(name) != found.get(name):
                problems.append(f"{name}: {found.get(name)} on {node}, {reference.get(name)} on {first}")
    return problems


def unreachable(address: str, seconds: float = 5.0) -> str | None:
    """Why a head at HOST:PORT (or ray://HOST:PORT) cannot be reached, or None where it answers
    or the address is not of that form ('auto', 'local')."""
    host, colon, port = address.removeprefix("ray://").rpartition(":")
    if not colon or not port.isdigit():
        return None
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=seconds).close()
    except OSError as error:
        return f"nothing answers at {host}:{port} ({error.strerror or type(error).__name__})"
    return None


def fingerprint() -> dict[str, str | None]:
    """What must agree across the nodes: this project's version, Python's and every framework's."""
    from conformance.machine import framework_versions, project_version

    return {"transformer-rosetta": project_version(), **framework_versions()}


def _node_name(node_id: str, hostname: str) -> str:
    return f"{hostname} (node {node_id[:8]})"


# ---- the actor ---------------------------------------------------------------------------

def _writable(value):
    """A copy that a backend may write into (the object store's arrays are read-only)."""
    if isinstance(value, np.ndarray):
        return np.array(value)
    if isinstance(value, dict):
        return {key: _writable(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_writable(item) for item in value]
    if isinstance(value, tuple):
        return tuple(_writable(item) for item in value)
    return value


class ColumnGroup:
    """What runs in one actor: the weights, the runners its columns load, and run_cell."""

    def __init__(self, cfg_json: str, params: Mapping[str, np.ndarray], backends: Mapping[str, str]):
        for name, path in backends.items():  # as registered on the driver, at run time too
            register_backend(name, path)
        self.cfg = ModelConfig.from_json(cfg_json)
        self.params = {name: np.array(value) for name, value in params.items()}
        self.runners: dict = {}

    def where(self, column: Column) -> dict:
        """The node, device, driver and versions that this column's cells ran on."""
        import ray

        from conformance.machine import device_facts

        name, _, device = column
        backend, _ = get_backend(name)
        facts = device_facts(device)
        if device != "cpu" and backend is not None and hasattr(backend, "device_name"):
            try:
                facts["name"] = backend.device_name(device)
            except Exception:  # noqa: BLE001 - the name is a courtesy; nvidia-smi's stays
                pass
        return {"node_id": ray.get_runtime_context().get_node_id(), "hostname": socket.gethostname(),
                "device": facts["name"], "driver": facts["driver"], "pid": os.getpid(),
                "gpu_ids": [str(gpu) for gpu in ray.get_gpu_ids()], "versions": fingerprint()}

    def run(self, case, reference, column: Column) -> CellResult:
        name, dtype, device = column
        backend, reason = get_backend(name)
        present = backend.devices() if backend is not None else []
        if device not in present:
            reason = reason or f"device {device} not present for {name} on {socket.gethostname()}"
            return CellResult(name, device, dtype, case.sublayer, case.mask_case, SKIP, reason=reason,
                              skip=unavailable_kind(reason))
        case = replace(case, inputs=_writable(case.inputs))
        return run_cell(self.cfg, self.params, case, name, dtype, device, reference, self.runners)


def _fingerprint_here() -> tuple[str, str, dict]:
    import ray

    return ray.get_runtime_context().get_node_id(), socket.gethostname(), fingerprint()


# ---- the executor ------------------------------------------------------------------------

@dataclass
class _Group:
    """A column group's actor on the driver's side: the cell it is running, and those to come in order."""

    columns: list[Column]
    requirement: dict[str, float]
    actor: object = None
    pending: dict = field(default_factory=dict)  # ObjectRef -> WorkItem: the one cell in flight
    queue: deque = field(default_factory=deque)  # the WorkItems not yet given to the actor


class RayCluster:
    """The Executor of a Ray cluster. `address`: None starts a cluster on this machine (or joins
    the one RAY_ADDRESS names), 'auto' joins the one running here, HOST:PORT joins that one;
    if Ray is already initialized in this process its cluster is used and left running.
    `accelerator` names the GPU kind CUDA columns need (e.g. H100)."""

    def __init__(self, address: str | None = None, accelerator: str | None = None):
        ray = _ray()
        self.accelerator = accelerator
        self.placements: dict[str, dict] = {}  # "backend/dtype/device" -> where it ran
        self._groups: list[_Group] = []
        self.started = not ray.is_initialized()
        if self.started:
            os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
            if address and (why := unreachable(address)) is not None:  # ray.init would retry for minutes
                raise RayUnavailable(f"no Ray cluster at {address}: {why}")
            try:
                ray.init(address=address, include_dashboard=False, log_to_driver=False, configure_logging=False)
            except (ConnectionError, RuntimeError, ValueError) as error:
                raise RayUnavailable(f"no Ray cluster at {address or 'this machine'}: {error}") from None
        self.versions = self.preflight()

    # the cluster as it is now
    def nodes(self) -> list[dict]:
        """Every live node: {"id", "hostname", "resources"}."""
        ray = _ray()
        return [{"id": node["NodeID"], "hostname": node.get("NodeManagerHostname", "?"),
                 "resources": dict(node.get("Resources", {}))} for node in ray.nodes() if node.get("Alive")]

    def devices(self) -> list[str]:
        return cluster_devices([node["resources"] for node in self.nodes()])

    def fingerprints(self) -> dict[str, dict]:
        """Every live node's fingerprint, by the node's name: a task pinned to each node."""
        ray = _ray()
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        probe = ray.remote(num_cpus=0, max_retries=0)(_fingerprint_here)
        answers = ray.get([probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node["id"], soft=False))
                           .remote() for node in self.nodes()])
        return {_node_name(node_id, host): prints for node_id, host, prints in answers}

    def preflight(self) -> dict[str, dict]:
        """Every live node's fingerprint; ClusterMismatch where two differ."""
        found = self.fingerprints()
        if problems := version_mismatches(found):
            raise ClusterMismatch("the Ray cluster's nodes run different versions, and a matrix from them would "
                                  "mix them:\n  " + "\n  ".join(problems) + "\ninstall the same versions on every "
                                  "node (the same constraints.txt), or run each kind apart and `rosetta merge` them")
        return found

    def run(self, cfg: ModelConfig, params: Mapping[str, np.ndarray], work: Sequence[WorkItem],
            on_result: OnResult) -> None:
        ray = _ray()
        by_column: dict[Column, list[WorkItem]] = {}
        for item in work:
            by_column.setdefault(item.column, []).append(item)
        nodes = [node["resources"] for node in self.nodes()]
        groups = []
        for columns in column_groups(sorted(by_column, key=cost_rank)):
            requirement = column_requirement(columns[0], self.accelerator)
            if (why := unplaceable_reason(requirement, nodes)) is not None:  # skipped, never waited for
                for column in columns:
                    for item in by_column[column]:
                        if on_result(item.index, _cell(item, SKIP, why, ABSENT)):  # no node has its device
                            return
            else:
                groups.append(_Group(columns, requirement))
        if not groups:
            return
        # the golden once per case that a placed column runs, computed here and shared through the object store
        golden, references, shared = golden_runner_for(cfg, params), {}, {}
        for item in (item for group in groups for column in group.columns for item in by_column[column]):
            if item.case.name not in shared:
                shared[item.case.name] = (ray.put(item.case),
                                          ray.put(reference_for(cfg, params, item.case, golden, references)))
        weights = ray.put({name: np.ascontiguousarray(value) for name, value in params.items()})
        # what a group's actor is started with, and each cell's arguments (the object store's refs)
        self._submission = (ray.remote(ColumnGroup), (cfg.to_json(), weights, registered_paths()), by_column, shared)
        self._groups = groups
        for group in groups:
            self._start(group, group.columns)
        try:
            self._gather(groups, on_result)
        finally:
            self.placements = {column: _resolved(where) for column, where in self.placements.items()}
            self._release()

    def _start(self, group: _Group, columns: list[Column]) -> None:
        """A new actor for the group, each column's `where` asked first, then its first cell."""
        actor_class, setup, by_column, _ = self._submission
        extra = {name: amount for name, amount in group.requirement.items() if name not in ("CPU", "GPU")}
        group.actor = actor_class.options(num_cpus=group.requirement.get("CPU", 0.0),
                                          num_gpus=group.requirement.get("GPU", 0.0), resources=extra or None,
                                          max_restarts=0, max_task_retries=0).remote(*setup)
        for column in columns:
            self.placements[_column_key(column)] = group.actor.where.remote(column)
            group.queue.extend(by_column[column])
        self._submit_next(group)

    def _submit_next(self, group: _Group) -> None:
        """Give the group's actor its next cell; with none left its resources go to a group still waiting."""
        if group.queue:
            item = group.queue.popleft()
            case, reference = self._submission[3][item.case.name]
            group.pending[group.actor.run.remote(case, reference, item.column)] = item
        else:
            _ray().kill(group.actor)
            group.actor = None

    def _gather(self, groups: list[_Group], on_result: OnResult) -> None:
        ray = _ray()
        owner = {ref: group for group in groups for ref in group.pending}
        while owner:
            ray.wait(list(owner), num_returns=1)  # an actor's death makes its cell ready too
            ready, _ = ray.wait(list(owner), num_returns=len(owner), timeout=0)
            for ref in ready:
                if self._take(ref, owner, on_result):
                    return

    def _take(self, ref, owner: dict, on_result: OnResult) -> bool:
        """Report one finished cell, or its actor's death; True when the run should stop."""
        ray = _ray()
        group = owner.pop(ref)
        try:
            result = ray.get(ref)
        except ray.exceptions.RayActorError as died:
            return self._lost(group, died, owner, on_result)
        except ray.exceptions.RayError as error:
            result = _cell(group.pending[ref], ERROR, f"{type(error).__name__}: {' '.join(str(error).split())[:600]}")
        item = group.pending.pop(ref)
        key = _column_key(item.column)
        if not isinstance(self.placements.get(key), dict):  # answered before the column's first cell
            self.placements[key] = _resolved(self.placements.get(key))
        self._submit_next(group)  # the actor works on while the driver reports
        owner.update({ref: group for ref in group.pending})
        return on_result(item.index, result)

    def _lost(self, group: _Group, died, owner: dict, on_result: OnResult) -> bool:
        """The group's actor is gone: the cell it was running and the rest of that column are
        errors that quote Ray's detail; a new actor takes the group's columns not started."""
        (item,) = group.pending.values()
        left, group.pending, group.queue = [item, *group.queue], {}, deque()
        crashed = item.column
        detail = " ".join(str(died).split())[:600]
        for item in [item for item in left if item.column == crashed]:
            if on_result(item.index, _cell(item, ERROR, f"the Ray actor running this column died ({detail})")):
                return True
        if later := list(dict.fromkeys(item.column for item in left if item.column != crashed)):
            self._start(group, later)
            owner.update({ref: group for ref in group.pending})
        else:
            group.actor = None
        return False

    def _release(self) -> None:
        """Kill the actors still alive (a run stopped early, or failed)."""
        ray = _ray()
        for group in self._groups:
            if group.actor is not None:
                ray.kill(group.actor)
                group.actor = None
        self._groups = []

    def close(self) -> None:
        """Kill what this executor started: its actors, and the cluster where it started one."""
        ray = _ray()
        if ray.is_initialized():
            self._release()
            if self.started:
                ray.shutdown()
        self.started = False


def _column_key(column: Column) -> str:
    return "/".join(column)


def _resolved(where) -> dict | None:
    """A placement's answer: None where the actor died before it gave one, the error where
    asking failed."""
    ray = _ray()
    if where is None or isinstance(where, dict):
        return where
    try:
        return ray.get(where, timeout=30)
    except ray.exceptions.RayActorError:
        return None
    except ray.exceptions.RayError as error:
        return {"error": f"{type(error).__name__}: {' '.join(str(error).split())[:300]}"}


def _cell(item: WorkItem, status: str, reason: str, skip: str = "") -> CellResult:
    name, dtype, device = item.column
    return CellResult(name, device, dtype, item.case.sublayer, item.case.mask_case, status, reason=reason, skip=skip)
