"""The docs stay honest: every `rosetta` command they quote parses with today's CLI, every code
excerpt on the generated pages is the source as it is, and the generated pages are what their
generators write today (measured numbers masked: they may move in the last digit between
machines, the text around them may not). The README stays a front page, and every figure it
states is in a committed file it links (the rule is written out above its tests, below)."""

import re
import shlex
from pathlib import Path

import pytest

from pages.differences import differences_page, excerpt
from rosetta.main import build_parser

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _quoted_commands():
    for page in PAGES:
        in_code = False
        for line in page.read_text().splitlines():
            if line.startswith("```"):
                in_code = not in_code
                continue
            text = line.strip().removeprefix("$ ")
            if in_code and text.startswith("rosetta "):
                yield pytest.param(page.name, text.split("  #")[0].split(" # ")[0].strip(),
                                   id=f"{page.name}:{text[:50]}")


@pytest.mark.parametrize("page, command", list(_quoted_commands()))
def test_quoted_commands_parse(page, command):
    argv = shlex.split(command)[1:]
    argv = [word for word in argv if word not in ("...", "…") and not word.startswith("(")]
    argv = [re.sub(r"\[|\]", "", word).split("|")[0] for word in argv]  # "[--dtype a|b]" -> "--dtype a"
    argv = [word for word in argv if word and word != "|"]
    try:
        build_parser().parse_args(argv)
    except SystemExit as error:
        pytest.fail(f"{page}: `{command}` does not parse (exit {error.code})")


def test_there_are_commands_to_check():
    assert len(list(_quoted_commands())) >= 15


def _excerpt_blocks(text: str):
    """(path, name, code) for each '**label** — `path` · `name`' heading followed by a python block."""
    pattern = re.compile(r"— `([^`]+)` · `([^`]+)`\n\n```python\n(.*?)\n```", re.S)
    return pattern.findall(text)


def test_excerpts_are_the_source_as_it_is():
    from pages.differences import source_of

    blocks = _excerpt_blocks((ROOT / "docs" / "framework-differences.md").read_text())
    assert len(blocks) >= 20
    for path, name, code in blocks:
        assert code == source_of(path, name), f"the excerpt of {path}:{name} is stale"


def _masked(text: str) -> str:
    return re.sub(r"\d+(\.\d+)?(e[-+]?\d+)?", "N", text)


def _versions_line(text: str) -> str:
    """The installed versions and the CPU's int8 path (the page's measurements depend on both)."""
    return "\n".join(line for line in text.splitlines() if line.startswith(("Versions: ", "CPU int8 path: ")))


def _skeleton(text: str) -> list[str]:
    """What the page says whatever the machine: headings, excerpt titles and the code blocks.
    The bullets between them quote measurements (a probe's verdict, an error), which another
    framework version may legitimately change."""
    kept, in_code = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            in_code = not in_code
        if in_code or line.startswith(("#", "**", "```")):
            kept.append(line)
    return kept


def test_the_differences_page_is_current():
    """Word for word (numbers masked) where the installed versions are the page's own; elsewhere
    (the frameworks of a lent GPU machine, a user's newer jax) its skeleton, so the check does not
    depend on which packages are installed."""
    committed, expected = (ROOT / "docs" / "framework-differences.md").read_text(), differences_page()
    hint = "regenerate with: rosetta differences --markdown docs/framework-differences.md"
    if _versions_line(committed) == _versions_line(expected):
        assert _masked(committed) == _masked(expected), hint
    else:
        assert _skeleton(committed) == _skeleton(expected), hint
    assert len(_skeleton(committed)) > 100


def test_the_page_check_holds_on_other_versions():
    """The same page under another versions line and another measured verdict still passes the
    skeleton check, and a stale excerpt in it still fails."""
    committed = (ROOT / "docs" / "framework-differences.md").read_text()
    elsewhere = committed
    for line, other in zip(_versions_line(committed).splitlines(), ("Versions: python 3.12.0, torch 2.11.0+cu130",
                                                                     "CPU int8 path: AVX2 without VNNI")):
        elsewhere = elsewhere.replace(line, other)
    assert _versions_line(elsewhere) != _versions_line(committed)
    elsewhere = elsewhere.replace("the mean of V", "zeros")
    assert _skeleton(elsewhere) == _skeleton(committed)
    stale = elsewhere.replace("def split_heads(", "def split_the_heads(", 1)
    assert _skeleton(stale) != _skeleton(committed)


def test_the_optimizer_defaults_the_page_states_are_installed():
    """The check above masks numbers, so a framework release that moved AdamW's default weight
    decay would pass it: the training section's defaults are read again from torch and optax, and
    are the ones SPEC.md §14 and the comments in impl_torch/impl_jax training.py quote."""
    import inspect

    import optax
    import torch

    torch_default = torch.optim.AdamW([torch.zeros(1, requires_grad=True)]).defaults["weight_decay"]
    optax_default = inspect.signature(optax.adamw).parameters["weight_decay"].default
    page = (ROOT / "docs" / "framework-differences.md").read_text()
    assert f"AdamW's weight decay by default: {torch_default:g} in torch" in page
    assert f", {optax_default:g} in optax (`inspect.signature(optax.adamw)`)" in page
    assert (torch_default, optax_default) == (1e-2, 1e-4), "SPEC.md §14 and impl_*/training.py quote 1e-2 and 1e-4"


def test_excerpt_finds_functions_methods_and_refuses_unknown_names():
    assert excerpt("impl_numpy/model.py", "softmax").startswith("def softmax(")
    assert excerpt("impl_torch/model.py", "Transformer.from_params").startswith("@classmethod")
    with pytest.raises(KeyError, match="no_such_function"):
        excerpt("impl_numpy/model.py", "no_such_function")


def test_the_huggingface_mapping_tables_are_the_code():
    from importers.huggingface import FAMILIES, mapping_markdown

    page = (ROOT / "docs" / "huggingface.md").read_text()
    for family in FAMILIES:
        assert mapping_markdown(family) in page, f"regenerate the {family} table of docs/huggingface.md"


# ---- the README: a front page whose figures can be traced ------------------------------------
#
# The rule. A *figure* is a measured quantity in README.md, in prose, a table or a code block:
#   - a number directly followed by ×, x or %            ("2.24×", "1.03x", "15%");
#   - a number, then one space or none, then a unit        ("82.9 s", "607 tokens/s", "27 GB/s")
#     of FIGURE_UNITS;
#   - a date written YYYY-MM-DD, the day of a measurement ("2026-11-25").
# A number glued to a letter or a point before it ("b8", "p25", "log10") is not one, and neither
# is a count of the tree's own ("103 cases", "40 mistakes": test_the_readme_counts_are_the_trees
# checks those). Each figure must appear verbatim (runs of whitespace read as one space, and not
# inside a longer number or word) in a file that the same paragraph, list item or table row links
# to: a relative link to a file committed to git. A code block links nothing, so a figure in one
# fails: the README keeps its figures few, as headline ratios beside their date and machine class,
# and the figures themselves live in docs/benchmarks.md and reports/.

FIGURE_UNITS = ("tokens/s", "GFLOP/s", "GB/s", "GiB", "GB", "MB", "ms", "µs", "seconds", "minutes", "s")
FIGURE = re.compile(r"(?<![\w.,])(?:\d{4}-\d\d-\d\d|\d[\d,]*(?:\.\d+)?(?:[×x%]| ?(?:"
                    + "|".join(re.escape(unit) for unit in FIGURE_UNITS) + r")))(?![\w/])")
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _blocks(text: str) -> list[tuple[int, str, bool]]:
    """(first line number, text, is code) of each paragraph, list item, table row and code block."""
    blocks, current, first, in_code = [], [], 0, False

    def close(code=False):
        if current:
            blocks.append((first, "\n".join(current), code))
            current.clear()

    for number, line in enumerate(text.splitlines(), 1):
        starts_item = re.match(r"\s*([-*+]|\d+\.)\s|\s*\|", line)
        if line.startswith("```"):
            if in_code:
                current.append(line)
                close(code=True)
            else:
                close()
                first, current[:] = number, [line]
            in_code = not in_code
        elif in_code:
            current.append(line)
        elif not line.strip() or starts_item:
            close()
            if line.strip():
                first, current[:] = number, [line]
        else:
            first = number if not current else first
            current.append(line)
        if not in_code and line.lstrip().startswith("|"):
            close()  # a table row is a block of its own
    close(code=in_code)
    return blocks


def _committed_files(root: Path) -> set[str] | None:
    """The paths git tracks under root, or None where root is not a git work tree."""
    import subprocess

    try:
        listed = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return set(listed.stdout.decode().split("\0")) - {""}


def readme_figures(text: str) -> list[str]:
    return [match.group() for _, block, _ in _blocks(text) for match in FIGURE.finditer(block)]


def untraceable_figures(text: str, root: Path, committed: set[str] | None) -> list[str]:
    """'line N: FIGURE ...' for each figure of `text` that no committed file linked from its own
    block holds (`committed` None: every existing file counts as committed)."""
    problems = []
    for first, block, is_code in _blocks(text):
        figures = list(FIGURE.finditer(block))
        if not figures:
            continue
        targets = [] if is_code else [link.split("#")[0] for link in LINK.findall(block)
                                      if "://" not in link and not link.startswith(("#", "mailto:"))]
        files = [target for target in dict.fromkeys(targets) if (root / target).is_file()
                 and (committed is None or Path(target).as_posix() in committed)]
        texts = {target: " ".join((root / target).read_text(errors="replace").split()) for target in files}
        for match in figures:
            line = first + block.count("\n", 0, match.start())
            figure = " ".join(match.group().split())
            pattern = re.compile(r"(?<![\w.,])" + re.escape(figure) + r"(?![\w/])")
            if not files:
                where = "a code block links nothing" if is_code else "its block links no committed file"
                problems.append(f"line {line}: {figure}: {where}")
            elif not any(pattern.search(body) for body in texts.values()):
                problems.append(f"line {line}: {figure}: in none of {', '.join(files)}")
    return problems


def test_the_readme_is_a_front_page():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 150, "move the detail into docs/"


def test_every_readme_figure_is_in_a_committed_file_it_links():
    text = (ROOT / "README.md").read_text()
    assert len(readme_figures(text)) >= 5, "the rule finds no figures: is it still reading the README?"
    problems = untraceable_figures(text, ROOT, _committed_files(ROOT))
    assert not problems, "README figures that no linked committed file holds:\n" + "\n".join(problems)


@pytest.mark.parametrize("text, figures", [
    ("took 82.9 s cold and 20.5 s warm", ["82.9 s", "20.5 s"]),
    ("2.24× CTranslate2, 1.03x torch, 62% of the limit", ["2.24×", "1.03x", "62%"]),
    ("607 tokens/s at 213 GFLOP/s and 29.0 GB/s, 255 MB, 7.0 ms", ["607 tokens/s", "213 GFLOP/s", "29.0 GB/s",
                                                                 "255 MB", "7.0 ms"]),
    ("measured on 2026-11-25", ["2026-11-25"]),
    ("b8 × 64 tokens, p25-p75, log10(error), Python 3.11, SPEC.md §8, 103 cases, 1/3, 2-core, 0x1f, 6 steps", []),
])
def test_what_counts_as_a_figure(text, figures):
    assert readme_figures(text) == figures


def test_an_untraceable_figure_is_reported(tmp_path):
    """The rule run on a planted README: only the figures that a committed file linked from their
    own paragraph, list item or table row holds pass."""
    (tmp_path / "bench.md").write_text("forward: 1.25× torch eager\n(2026-11-23), the matrix took\n82.9 s; 12.5%\n")
    (tmp_path / "notes.md").write_text("3.14× faster\n")  # holds the planted figure, but is not committed
    planted = "\n".join([
        "Traced: 1.25× torch eager (2026-11-23, [bench](bench.md)).",
        "",
        "Planted: 3.14× torch eager, a figure no linked file holds ([bench](bench.md), [notes](notes.md)).",
        "",
        "Unlinked: the matrix took 82.9 s.",
        "",
        "- a list item with its link: 82.9 s ([bench](bench.md))",
        "- its neighbour, without: 1.25×",
        "",
        "| row | 1.25× | [bench](bench.md) |",
        "| row | 2.5% | [bench](bench.md) |",
        "| row | 1.25× | [missing](missing.md) |",
        "",
        "```",
        "rosetta check --preset tiny   # 82.9 s, as [bench](bench.md) says",
        "```",
    ])
    problems = untraceable_figures(planted, tmp_path, committed={"bench.md"})
    assert problems == [
        "line 3: 3.14×: in none of bench.md",
        "line 5: 82.9 s: its block links no committed file",
        "line 8: 1.25×: its block links no committed file",
        "line 11: 2.5%: in none of bench.md",  # 12.5% is another figure
        "line 12: 1.25×: its block links no committed file",
        "line 15: 82.9 s: a code block links nothing",
    ]
    assert untraceable_figures(planted.replace("3.14×", "1.25×"), tmp_path, {"bench.md"})[0].startswith("line 5:")
    assert "line 3: 3.14×" not in " ".join(untraceable_figures(planted, tmp_path, {"bench.md", "notes.md"}))


def test_the_readme_counts_are_the_trees():
    """The counts the README states (not figures: the tree's own) are the tree's today."""
    from conformance.cases import case_names, is_gradient, is_training
    from spec import get_preset

    text = " ".join((ROOT / "README.md").read_text().split())
    tiny = get_preset("tiny")
    forward, every = case_names(tiny), case_names(tiny, backward=True)
    added = [case for case in every if case not in forward]
    gallery = [line for line in (ROOT / "docs" / "mutation-gallery.md").read_text().splitlines()
               if line.startswith("| `")]
    stated = {
        r"(\d+) cases per column": len(forward),
        r"adds (\d+) gradient": sum(is_gradient(sublayer) for sublayer, _ in added),
        r"and (\d+) training cases": sum(is_training(sublayer) for sublayer, _ in added),
        r"(\d+) classic mistakes": len(gallery),
    }
    for pattern, count in stated.items():
        found = re.search(pattern, text)
        assert found, f"the README no longer says /{pattern}/: update this test"
        assert int(found.group(1)) == count, f"the README says {found.group()}, the tree has {count}"


def test_the_readme_links_resolve():
    text = (ROOT / "README.md").read_text()
    targets = [link.split("#")[0] for link in LINK.findall(text) if "://" not in link and not link.startswith("#")]
    assert targets, "the README links nothing"
    missing = [target for target in targets if not (ROOT / target).exists()]
    assert not missing, f"README links to paths that do not exist: {missing}"
