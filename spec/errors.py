"""The error classes every component raises for bad configs, weights and inputs.

They all derive from ``SpecError`` (itself a ``ValueError``), so a caller can catch one class
and a test can assert that every backend refuses the same bad input with the same class.
"""


class SpecError(ValueError):
    """Base class: something does not meet the Transformer Rosetta spec."""


class ConfigError(SpecError):
    """A ModelConfig (or its JSON) is invalid. The message names the field."""


class WeightsError(SpecError):
    """A parameter set or a weights file does not match the spec. The message lists every offender."""


class InputError(SpecError):
    """Token ids, masks or activations handed to a model are invalid."""
