"""The one base class of refused input, at the bottom of the house so every layer raises it: a configuration
value, a recipe, a model, calibration data or an artifact the code will not take. The message names the field,
the allowed values and what was given. Its kinds: stages.base re-exports it (NonFiniteError), exporters' CodecError
and ManifestError, pipeline.errors.UserError; the command line exits EXIT_USER for every one of them. A plain
ValueError, by contrast, is a broken internal invariant (EXIT_INTERNAL)."""
from __future__ import annotations


class InputError(ValueError):
    """Bad input refused on purpose; the message names the field, what is allowed and what was given."""


__all__ = ["InputError"]
