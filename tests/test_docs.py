"""The docs stay honest: every `rosetta` command they quote parses with today's CLI, every code
excerpt on the generated pages is the source as it is, and the generated pages are what their
generators write today (measured numbers masked: they may move in the last digit between
machines, the text around them may not)."""

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
    return next((line for line in text.splitlines() if line.startswith("Versions: ")), "")


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
    elsewhere = committed.replace(_versions_line(committed), "Versions: python 3.12.0, torch 2.11.0+cu130")
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
    from importers.huggingface import mapping_markdown

    page = (ROOT / "docs" / "huggingface.md").read_text()
    for family in ("gpt2", "marian", "bart", "llama", "qwen2", "qwen3"):
        assert mapping_markdown(family) in page, f"regenerate the {family} table of docs/huggingface.md"
