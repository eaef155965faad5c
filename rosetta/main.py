"""The ``rosetta`` command (also ``python -m rosetta``).

    rosetta check [--preset tiny | --weights FILE] [--hf DIR] [--backends a,b] [--dtypes ...] [--devices ...]
                  [-k FILTER] [--fail-fast] [--report DIR] [--jobs N] [--shard I/N]
    rosetta merge REPORT... --out DIR
    rosetta import DIR --out FILE.safetensors
    rosetta export [--preset tiny | --weights FILE] --out DIR [--framework torch|jax] [--dtype float32|float16]
                   [--opset 23|20] [--graphs a,b] [--triton REPO]
    rosetta generate DIR (--src "5 6 7" ... | --prompt "5 6" ...) [--bos 1] [--eos 2] [--max-new-tokens N]
                   [--device auto|cpu|cuda] [--allow-cpu-fallback] [--placement]
    rosetta bench [--preset tiny | paper-base | llama-small] [--out DIR] [--contenders a,b]
    rosetta gpu [--out reports/gpu] [--device cuda|cpu] [--presets ...] [--backends ...] [--bench-preset NAME|none]
    rosetta refusals [--markdown FILE]
    rosetta differences [--markdown FILE]
    rosetta presets
    rosetta init --preset NAME [--seed N] OUT.safetensors
    rosetta info FILE.safetensors

Each subcommand lives in the module of its family (rosetta/__init__.py lists them) and registers
its parser here, in the order `rosetta --help` shows them.

Exit codes: 0 every cell that ran passed, 1 a cell failed (or none ran), 2 usage or input error.
"""

from __future__ import annotations

import argparse
import sys

from rosetta import bench, check, export_commands, gpu, page_commands, weights
from rosetta.arguments import UsageError
from spec import SpecError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rosetta", description="Transformer Rosetta: one Transformer, "
                                     "four implementations, checked against one golden reference.")
    commands = parser.add_subparsers(dest="command", required=True)
    check.add_check(commands)
    check.add_merge(commands)
    weights.add_import(commands)
    page_commands.add_mutations(commands)
    page_commands.add_train_parity(commands)
    page_commands.add_backward_page(commands)
    page_commands.add_probe(commands)
    gpu.add_gpu(commands, run_command=main)  # the job runs its steps as `rosetta` commands
    export_commands.add_export(commands)
    export_commands.add_generate(commands)
    page_commands.add_refusals(commands, command_line=main)  # the CLI is one of the entry points it observes
    bench.add_bench(commands)
    page_commands.add_differences(commands)
    weights.add_presets(commands)
    weights.add_init(commands)
    weights.add_info(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # the command line, for reports
    if args.command == "check":
        args.preset_given = args.preset is not None
        args.preset = args.preset or "tiny"
    try:
        return args.handler(args)
    except (UsageError, SpecError, ValueError, RuntimeError) as error:
        print(f"rosetta {args.command}: error: {error}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # output piped into `head` and closed early: nothing to report
        sys.stderr.close()
        return 1
    except OSError as error:
        print(f"rosetta {args.command}: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"\nrosetta {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
