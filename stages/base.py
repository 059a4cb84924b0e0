"""The one result type every stage returns, the checks shared by every stage, and the error a stage raises when
it refuses its input.

torch is imported only for type checking: pipeline/errors.py builds UserError on InputError, and the command
line imports it before anything heavy.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass
class StageResult:
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    meta: dict = field(default_factory=dict)


class InputError(ValueError):
    """Bad input refused on purpose: a configuration value, a model or a calibration input the code cannot
    handle; the message names the field, what is allowed and what was given. The command line exits EXIT_USER
    for it (pipeline/errors.py; pipeline.errors.UserError is one). A plain ValueError, by contrast, is a broken
    internal invariant and exits EXIT_INTERNAL."""


class NonFiniteError(InputError):
    """NaN or Inf in an activation or calibration sample; the message names layer and tensor."""


def check_finite(x: torch.Tensor, where: str) -> None:
    finite = x.isfinite()
    if not finite.all():
        bad = int((~finite).sum())
        raise NonFiniteError(f"non-finite values ({bad} NaN/Inf entries) in {where}")
