"""The one result type every stage returns, the checks shared by every stage, and the error a stage raises when
it refuses its input.

torch is imported only for type checking: pipeline/errors.py builds UserError on InputError, and the command
line imports it before anything heavy.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from exporters.errors import InputError  # the one base class of refused input (re-exported for the stages)

if TYPE_CHECKING:
    import torch


@dataclass
class StageResult:
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    meta: dict = field(default_factory=dict)


class NonFiniteError(InputError):
    """NaN or Inf in an activation or calibration sample; the message names layer and tensor."""


def check_finite(x: torch.Tensor, where: str) -> None:
    finite = x.isfinite()
    if not finite.all():
        bad = int((~finite).sum())
        raise NonFiniteError(f"non-finite values ({bad} NaN/Inf entries) in {where}")


# ---------------------------------------------------------------------------------------------------------------
# Stage declarations. A stage module declares its stage once (name, config dataclass, inputs, fit); the runner
# (pipeline/runner.py) computes the cache key from the WHOLE config instance it hands to fit, plus the inputs'
# keys and the model / data / code identities. Nothing at a call site chooses what goes into a key: fit receives
# exactly the config the key was computed from, and everything else it reads comes from its inputs (other stages'
# results, keyed) or the Context (the model and the windows, covered by the model and data identities).
# A config field that provably does not change results is left out of the key by an explicit declaration on its
# dataclass:  KEY_EXCLUDED: ClassVar[dict[str, str]] = {"field": "why it cannot change a result"}.


@dataclass
class Context:
    """What every stage may read besides its config and inputs; the runner keys it by identity (the model's
    weights, tokenizer, dtype and device; the calibration and evaluation windows' token ids)."""
    model: object                 # torch.nn.Module
    spec: object                  # pipeline.model.ModelSpec
    tokenizer: object = None
    calib: torch.Tensor | None = None   # [N, T] calibration token ids
    eval: torch.Tensor | None = None    # [M, T] evaluation token ids
    long: torch.Tensor | None = None    # [K, T_long] long-context evaluation token ids (data.long_n_samples)


def key_view(config) -> object:
    """The JSON-able value of `config` that enters a cache key: every field of every (nested) dataclass except
    those its class declares in KEY_EXCLUDED; lists, tuples and dicts walked; other values as they are."""
    import dataclasses
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        excluded = getattr(type(config), "KEY_EXCLUDED", {})
        return {"__type__": type(config).__name__,
                **{f.name: key_view(getattr(config, f.name)) for f in dataclasses.fields(config)
                   if f.name not in excluded}}
    if isinstance(config, (list, tuple)):
        return [key_view(v) for v in config]
    if isinstance(config, dict):
        return {str(k): key_view(v) for k, v in config.items()}
    if config is None or isinstance(config, (bool, int, float, str)):
        return config
    raise TypeError(f"a stage config holds {type(config).__name__} ({config!r}); a cache key takes dataclasses, "
                    f"lists, dicts and JSON scalars only")


def _no_inputs(config) -> list[str]:
    return []


def _one_unit(ctx: Context, config) -> int:
    return 1


def calib_units(ctx: Context, config) -> int:
    """A progress unit per calibration window."""
    return ctx.calib.shape[0]


def eval_units(ctx: Context, config) -> int:
    """A progress unit per evaluation window."""
    return ctx.eval.shape[0]


@dataclass(frozen=True)
class Declaration:
    """A stage, declared once in its module. `fit(ctx, inputs, config, progress) -> StageResult`; `inputs(config)`
    names the stage results it reads (which may depend on the config: a prefix group reads traces-prefix);
    `suffix(config)` distinguishes several instances of one stage in a graph (one per calibration group or
    recipe); `units(ctx, config)` is the progress bar's total; bump `version` when the code changes its output."""
    name: str
    config: type
    fit: Callable
    inputs: Callable = _no_inputs
    suffix: Callable | None = None
    units: Callable = _one_unit
    version: int = 1

    def __call__(self, config) -> "Bound":
        if not isinstance(config, self.config):
            raise TypeError(f"stage {self.name} takes a {self.config.__name__} config, got {type(config).__name__}")
        suffix = self.suffix(config) if self.suffix else ""
        name = f"{self.name}-{suffix}" if suffix else self.name
        return Bound(self, config, name, tuple(self.inputs(config)))


@dataclass(frozen=True)
class Bound:
    """A declared stage with its config: one node of a stage graph."""
    declaration: Declaration
    config: object
    name: str
    deps: tuple[str, ...]
