"""The commands that measure and write pages: `rosetta mutations` (the mutation gallery and
docs/mistakes.md), `rosetta train-parity`, `rosetta backward-page`, `rosetta probe`,
`rosetta refusals` and `rosetta differences`."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from rosetta.arguments import CommandLine, UsageError, comma_list
from spec import conformance_params, get_preset


def cmd_mutations(args: argparse.Namespace) -> int:
    """Run the mutation gallery: every mistake must be caught and localized."""
    from pages.mutations import gallery_page, gallery_table, mistakes_page, run_gallery

    if args.quantized:
        return _quantized_mutations(args)
    preset = args.preset or "tiny"  # the pages name the preset they ran on, the default's too
    cfg = get_preset(preset)
    params = conformance_params(cfg, args.seed)
    start = time.perf_counter()
    verdicts = run_gallery(cfg, params)
    print(f"Mutation gallery on {preset}: each mistake applied to the numpy-float32 backend, "
          "the golden unchanged\n")
    print(gallery_table(verdicts))
    good = sum(v.caught and v.localized for v in verdicts)
    print(f"\n{good} of {len(verdicts)} mutations caught and localized in {time.perf_counter() - start:.1f} s")
    if args.markdown:
        Path(args.markdown).write_text(gallery_page(verdicts, preset))
    if args.mistakes:
        Path(args.mistakes).write_text(mistakes_page(verdicts, preset))
    return 0 if good == len(verdicts) else 1


def _quantized_mutations(args: argparse.Namespace) -> int:
    """The quantized deployment's mistakes (pages.quantized_mutations), on llama-tiny's int4 export."""
    from pages.quantized_mutations import PRESET, SCHEME, quantized_gallery_page, quantized_gallery_table, \
        run_quantized_gallery

    if args.preset not in (None, PRESET) or args.seed or args.mistakes:
        raise UsageError(f"--quantized plants its mistakes in {PRESET}'s conformance weights, whose names they "
                          "expect: it takes no --preset, --seed or --mistakes")
    start = time.perf_counter()
    verdicts = run_quantized_gallery()
    print(f"Quantized deployment mistakes on {PRESET} ({SCHEME.name}): each planted in the kernel or the export\n")
    print(quantized_gallery_table(verdicts))
    good = sum(v.caught and v.localized for v in verdicts)
    print(f"\n{good} of {len(verdicts)} mistakes caught and localized in {time.perf_counter() - start:.1f} s")
    if args.markdown:
        Path(args.markdown).write_text(quantized_gallery_page(verdicts))
    return 0 if good == len(verdicts) else 1


def cmd_train_parity(args: argparse.Namespace) -> int:
    """Train the golden, PyTorch and JAX side by side; draw the losses and the divergence."""
    from pages.train_parity import train_parity, write

    cfg = get_preset(args.preset)
    start = time.perf_counter()
    parity = train_parity(cfg, conformance_params(cfg, args.seed), args.steps, backends=args.backends.split(","),
                          dtype=args.dtype, batch=args.batch, length=args.length)
    files = write(parity, args.out, f"{args.preset}: {args.steps} AdamW steps, the frameworks at {args.dtype}")
    print(parity.table())
    print(f"\nloss tolerance {parity.loss_tolerance:.3g} (SPEC §8 at {args.dtype}); {args.steps} steps in "
          f"{time.perf_counter() - start:.1f} s; wrote {', '.join(str(f) for f in files)}")
    return 1 if parity.unavailable else 0


def cmd_backward_page(args: argparse.Namespace) -> int:
    """Rewrite the generated part of docs/backward.md from the code."""
    from pages.backward import backward_page

    current = args.markdown.read_text() if args.markdown.exists() else "# The backward half\n"
    args.markdown.write_text(backward_page(current))
    print(f"wrote {args.markdown}")
    return 0


def cmd_probe(args: argparse.Namespace) -> int:
    """What each framework's own primitives do on the spec's edge cases, measured here."""
    from pages.probe import probe_page, probe_table, run_probes

    observed = run_probes()
    print(probe_table(observed))
    if args.markdown:
        Path(args.markdown).write_text(probe_page(observed))
        devices = ", ".join(dict.fromkeys(device for _, device, _ in observed if device != "-"))
        print(f"wrote {args.markdown}: {len(observed)} observations, devices {devices}")
    return 0


def cmd_refusals(args: argparse.Namespace, command_line: CommandLine) -> int:
    """Every bad weights file and bad input of the catalogue through every entry point, the CLI's
    own (command_line, the `rosetta` entry point) among them."""
    from pages.refusals import ENTRY_POINTS, run_catalogue

    start = time.perf_counter()
    run = run_catalogue(tuple(comma_list(args.backends) or ENTRY_POINTS), command_line=command_line)
    print(run.table())
    problems = run.problems
    for case, found in problems.items():
        print(f"PROBLEM {case}:\n  " + "\n  ".join(found))
    observations = run.weights + run.inputs
    ran = [o for o in observations if o.error != "n/a"]
    print(f"{len(observations)} observations ({len(ran)} ran), {len(problems)} cases with problems, "
          f"in {time.perf_counter() - start:.1f} s")
    if args.markdown:
        Path(args.markdown).write_text(run.page())
    return 1 if problems else 0


def cmd_differences(args: argparse.Namespace) -> int:
    """The framework-differences page: source excerpts side by side and the measured differences."""
    from pages.differences import differences_page

    page = differences_page()
    print(page)
    if args.markdown:
        Path(args.markdown).write_text(page)
    return 0


def add_mutations(commands: argparse._SubParsersAction) -> None:
    mutations = commands.add_parser("mutations", help="run the mutation gallery (proof the harness can fail)")
    mutations.add_argument("--preset", help="the preset of the gallery (default tiny)")
    mutations.add_argument("--quantized", action="store_true",
                           help="the quantized deployment's mistakes instead (llama-tiny's int4 export)")
    mutations.add_argument("--seed", type=int, default=0)
    mutations.add_argument("--markdown", help="also write the table to this Markdown file")
    mutations.add_argument("--mistakes", help="also write the teaching page (docs/mistakes.md) to this file")
    mutations.set_defaults(handler=cmd_mutations)


def add_train_parity(commands: argparse._SubParsersAction) -> None:
    parity = commands.add_parser("train-parity", help="train the golden, PyTorch and JAX from the same weights on "
                                 "the same batches; plot the losses and the divergence (SPEC §14)")
    parity.add_argument("--preset", default="char-lm", help="a decoder-only byte model (default char-lm)")
    parity.add_argument("--seed", type=int, default=0)
    parity.add_argument("--steps", type=int, default=200)
    parity.add_argument("--batch", type=int, default=8)
    parity.add_argument("--length", type=int, default=64)
    parity.add_argument("--dtype", default="float32", choices=("float64", "float32", "bfloat16"))
    parity.add_argument("--backends", default="torch,jax")
    parity.add_argument("--out", type=Path, default=Path("reports/train-parity"),
                        help="folder for train-parity.png and train-parity.json (default reports/train-parity)")
    parity.set_defaults(handler=cmd_train_parity)


def add_backward_page(commands: argparse._SubParsersAction) -> None:
    page = commands.add_parser("backward-page", help="regenerate the generated part of docs/backward.md")
    page.add_argument("--markdown", type=Path, default=Path("docs/backward.md"))
    page.set_defaults(handler=cmd_backward_page)


def add_probe(commands: argparse._SubParsersAction) -> None:
    probe = commands.add_parser("probe", help="record what each framework's own primitives do on edge cases")
    probe.add_argument("--markdown", help="also write the table to this Markdown file")
    probe.set_defaults(handler=cmd_probe)


def add_refusals(commands: argparse._SubParsersAction, command_line: CommandLine) -> None:
    """command_line: the `rosetta` entry point, whose refusals the catalogue observes too."""
    refusals = commands.add_parser("refusals", help="every bad weights file and bad input, through every entry point")
    refusals.add_argument("--backends", help="comma-separated entry points (default: golden,torch,jax,onnx)")
    refusals.add_argument("--markdown", help="also write the tables to this Markdown file")
    refusals.set_defaults(handler=lambda args: cmd_refusals(args, command_line))


def add_differences(commands: argparse._SubParsersAction) -> None:
    differences = commands.add_parser("differences", help="where the frameworks differ: code side by side, measured")
    differences.add_argument("--markdown", help="also write the page to this Markdown file")
    differences.set_defaults(handler=cmd_differences)
