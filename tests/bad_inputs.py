"""Bad inputs every backend must refuse with the same InputError message (SPEC.md §10), taken
from the catalogue in pages/refusals.py (whose test runs every case through every entry
point); these are the tiny preset's forward and generation cases in the form the per-backend
tests parametrize over.
"""

from pages.refusals import BAD_INPUTS


def _forward_cases():
    for case in BAD_INPUTS:
        arguments = case.arguments()
        if case.call == "forward" and case.model == "tiny" and set(arguments) == {"src_ids", "tgt_ids"}:
            yield case.name, arguments["src_ids"], arguments["tgt_ids"], case.message


# (id, src_ids, tgt_ids, message regex)
BAD_FORWARD_INPUTS = list(_forward_cases())

# (id, keyword arguments of greedy_generate, message regex)
BAD_GENERATION = [(case.name, case.arguments(), case.message) for case in BAD_INPUTS
                  if case.call == "generate" and case.model == "tiny"]
