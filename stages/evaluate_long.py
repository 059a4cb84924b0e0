"""The long-context evaluation (data.long_n_samples > 0): every recipe of the run, and the mixed per-layer policy
when the run has one, evaluated as stages.evaluate does on the long windows (Context.long), where a KV cache is
the memory problem and where sinks and a recent window cost a fraction of a bit. The drift gate and `pipeline
recommend` read its figures when a run has them."""
from __future__ import annotations

from dataclasses import dataclass

from stages import evaluate
from stages.base import Context, Declaration, StageResult
from stages.evaluate import EvalConfig
from stages.layer_policy import Target, target_inputs, target_policy
from stages.recipe import QuantConfig, inputs_of, recipe_policy


@dataclass
class LongJob:
    """The evaluate-long stage's config: the evaluation's knobs, every recipe whole, and what the run exports
    (pipeline.app.target_of): its mixed per-layer policy is evaluated too when it has options."""
    eval: EvalConfig
    recipes: list[QuantConfig]
    target: Target


def _inputs(job: LongJob) -> list[str]:
    mixed = target_inputs(job.target) if job.target.options else []
    return list(dict.fromkeys(inputs_of(job.recipes) + mixed))


def _fit(ctx: Context, inputs: dict, job: LongJob, progress) -> StageResult:
    policies = [recipe_policy(q, ctx.spec.n_layers, inputs) for q in job.recipes]
    if job.target.options:
        policies.append(target_policy(job.target, ctx.spec.n_layers, inputs))
    return evaluate.fit(evaluate.Inputs(ctx.model, ctx.spec, ctx.long, policies), job.eval, progress)


STAGE = Declaration("evaluate-long", LongJob, _fit, inputs=_inputs, units=lambda ctx, job: ctx.long.shape[0])
