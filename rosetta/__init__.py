"""The `rosetta` command line, the top floor of the project: it may import every package below
(spec, the implementations, importers, export, conformance, benchmarks) and none of them
imports it. Each subcommand parses its arguments, calls a library function and prints.

- rosetta.main: the parser and the dispatch; `rosetta` and `python -m rosetta` run main().
- rosetta.arguments: what the commands share (usage errors, comma lists, writable folders).
- rosetta.check: check (the conformance matrix) and merge (the matrix from several reports).
- rosetta.weights: import, presets, init and info.
- rosetta.export_commands: export and generate.
- rosetta.page_commands: mutations, train-parity, backward-page, probe, refusals and differences.
- rosetta.bench: bench.
- rosetta.gpu: gpu, the whole GPU report, run as a sequence of the commands above.
"""
