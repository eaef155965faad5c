"""docs/backward.md's generated part (pages/backward.py) is current, and every golden
VJP appears in it beside the frameworks' code."""

from pathlib import Path

from pages.backward import BEGIN, END, FORWARDS, PRIMITIVES, _vjps, backward_page, generated_part

ROOT = Path(__file__).resolve().parents[1]


def test_the_backward_page_is_current():
    committed = (ROOT / "docs" / "backward.md").read_text()
    assert BEGIN in committed and END in committed
    assert committed == backward_page(committed), "regenerate with: rosetta backward-page --markdown docs/backward.md"


def test_every_vjp_is_on_the_page_with_its_framework_code():
    names = [name for name, _ in _vjps()]
    assert len(names) >= 25 and set(names) == set(FORWARDS)
    page = generated_part()
    for name in names:
        assert f"### `{name}`" in page
        torch_name, jax_name = FORWARDS[name]
        assert (torch_name and jax_name) or name in PRIMITIVES, name
    assert "| ∂q of the fully masked query | exactly 0 | exactly 0 |" in page


def test_the_prose_around_the_generated_part_is_kept():
    current = "# Title\n\nprose\n\n" + BEGIN + "\nSTALE TEXT\n" + END + "\n\nafter\n"
    fresh = backward_page(current)
    assert fresh.startswith("# Title\n\nprose\n\n" + BEGIN) and fresh.endswith(END + "\n\nafter\n")
    assert "STALE TEXT" not in fresh
