"""The pages built on the verdict: what a user reads rather than runs for a pass or a fail.

One module a page, each over conformance/ (the verdict machinery) and never under it:
differences (docs/framework-differences.md), probe (`rosetta probe`: the frameworks' own
primitives), mutations (the mutation gallery and docs/mistakes.md), refusals (the catalogue of
bad inputs and docs/refusals.md), backward (docs/backward.md's generated half) and train_parity
(`rosetta train-parity`).
"""
