"""The long-context evaluation (data.long_n_samples > 0): every recipe of the run, and the mixed per-layer policy
when the run has one, evaluated as stages.evaluate does on the long windows (Context.long), where a KV cache is
the memory problem and where sinks and a recent window cost a fraction of a bit. The drift gate and `pipeline
recommend` read its figures when a run has them."""
from __future__ import annotations

from dataclasses import dataclass, field

from stages import evaluate
from stages.base import Context, Declaration, StageResult
from stages.evaluate import EvalConfig
from stages.layer_policy import Target, target_inputs, target_policy
from stages.recipe import QuantConfig, inputs_of, recipe_policy


@dataclass
class LongJob:
    """The evaluate-long stage's config: the evaluation's knobs, every recipe whole, and the mixed policy's options
    (empty without layer_policy)."""
    eval: EvalConfig
    recipes: list[QuantConfig]
    options: list[QuantConfig] = field(default_factory=list)


def _inputs(job: LongJob) -> list[str]:
    mixed = target_inputs(Target(job.recipes[0], job.options)) if job.options else []
    return list(dict.fromkeys(inputs_of(job.recipes) + mixed))


def _fit(ctx: Context, inputs: dict, job: LongJob, progress) -> StageResult:
    policies = [recipe_policy(q, ctx.spec.n_layers, inputs) for q in job.recipes]
    if job.options:
        policies.append(target_policy(Target(job.recipes[0], job.options), ctx.spec.n_layers, inputs))
    return evaluate.fit(evaluate.Inputs(ctx.model, ctx.spec, ctx.long, policies), job.eval, progress)


STAGE = Declaration("evaluate-long", LongJob, _fit, inputs=_inputs, units=lambda ctx, job: ctx.long.shape[0])
