"""The one result type every stage returns, and the checks shared by every stage."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class StageResult:
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    meta: dict = field(default_factory=dict)


class NonFiniteError(ValueError):
    """NaN or Inf in an activation or calibration sample; the message names layer and tensor."""


def check_finite(x: torch.Tensor, where: str) -> None:
    if not torch.isfinite(x).all():
        bad = int((~torch.isfinite(x)).sum())
        raise NonFiniteError(f"non-finite values ({bad} NaN/Inf entries) in {where}")
