"""Mixed precision per layer under an average-bits budget (QAQ-style allocation by sensitivity).

Inputs: for every candidate option (a recipe of one family, e.g. kvquant-{2,3,4}b-1pct, plus fp16) the isolated
per-layer KL (only that layer quantized, measured on calibration windows) and the option's average bits per
element. Greedy by sensitivity per bit saved: start every layer at the most precise option and repeatedly move
the layer whose next step down costs the least KL per bit saved, until the average fits the budget. The sum of
isolated KLs is only a proxy -- the chosen stack is evaluated as a whole afterwards.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from exporters.codec import CachePolicy
from stages import evaluate
from stages.base import Context, Declaration, InputError, StageResult, eval_units
from stages.evaluate import EvalConfig
from stages.recipe import QuantConfig, inputs_of, recipe_policy


@dataclass
class Option:
    name: str
    bits: float                 # average bits per element of this option (from the ledger)
    kl: torch.Tensor            # [n_layers] isolated KL with only that layer on this option


def choose(options: list[Option], budget: float) -> list[int]:
    """-> option index per layer (options sorted by bits, descending)."""
    if not options:
        raise InputError("layer_policy needs at least one option")
    order = sorted(range(len(options)), key=lambda i: -options[i].bits)
    opts = [options[i] for i in order]
    if budget < opts[-1].bits:
        raise InputError(f"budget {budget} bits is below the cheapest option {opts[-1].name} ({opts[-1].bits:.3f} bits)")
    n_layers = opts[0].kl.numel()
    level = [0] * n_layers
    avg = lambda: sum(opts[lv].bits for lv in level) / n_layers  # noqa: E731
    while avg() > budget + 1e-12:
        best, best_cost = None, float("inf")
        for layer in range(n_layers):
            lv = level[layer]
            if lv + 1 >= len(opts):
                continue
            saved = opts[lv].bits - opts[lv + 1].bits
            cost = float(opts[lv + 1].kl[layer] - opts[lv].kl[layer]) / max(saved, 1e-9)
            if cost < best_cost:
                best, best_cost = layer, cost
        if best is None:
            break
        level[best] += 1
    return [order[lv] for lv in level]


def assemble(policies: list[CachePolicy], choice: list[int], name: str) -> CachePolicy:
    """Per-layer TensorPolicies from same-family policies (same RoPE stage, sinks, residual, smoothing)."""
    base = policies[0]
    for p in policies[1:]:
        if (p.key_rope, p.n_sink, p.residual) != (base.key_rope, base.n_sink, base.residual):
            raise InputError(f"mixed policy options must share key_rope / n_sink / residual: {base.name} vs {p.name}")
    layers = [policies[c].layers[i] for i, c in enumerate(choice)]
    return CachePolicy(name=name, layers=layers, key_rope=base.key_rope, n_sink=base.n_sink, residual=base.residual,
                       smooth=base.smooth)


@dataclass
class LayerPolicyConfig:
    """Mixed precision per layer under an average-bits budget."""
    enabled: bool = False
    budget: float = 3.0
    options: list[str] = field(default_factory=lambda: ["kvquant-2b-1pct", "kvquant-3b-1pct", "kvquant-4b-1pct"])
    n_windows: int = 1          # calibration windows for the per-layer sensitivity of each option

    # not in the cache key: with enabled=false the layer-policy stages are not in the graph at all
    KEY_EXCLUDED: ClassVar[dict[str, str]] = {"enabled": "whether the stages run, not what they compute"}


def fit(options: list[Option], cfg: LayerPolicyConfig) -> StageResult:
    """options: one per candidate recipe (isolated per-layer KL and average bits) -> the choice per layer."""
    budget = cfg.budget
    choice = choose(options, budget)
    bits = [options[c].bits for c in choice]
    return StageResult({"choice": torch.tensor(choice)},
                       {"budget": budget, "options": [o.name for o in options], "option_bits": [o.bits for o in options],
                        "choice": [options[c].name for c in choice], "predicted_avg_bits": sum(bits) / len(bits),
                        "predicted_kl": float(sum(options[c].kl[i] for i, c in enumerate(choice)))})


@dataclass
class Target:
    """The policy a diagnostic stage judges: a recipe, or (options non-empty) the mixed per-layer policy the
    evaluate-mixed stage chose among those options."""
    recipe: QuantConfig
    options: list[QuantConfig] = field(default_factory=list)


def target_inputs(t: Target) -> list[str]:
    """The stage results target_policy reads."""
    return ["evaluate-mixed", *inputs_of(t.options)] if t.options else inputs_of([t.recipe])


def target_policy(t: Target, n_layers: int, inputs: dict) -> CachePolicy:
    if not t.options:
        return recipe_policy(t.recipe, n_layers, inputs)
    mixed = inputs["evaluate-mixed"]
    return assemble([recipe_policy(q, n_layers, inputs) for q in t.options], mixed.tensors["choice"].tolist(),
                    mixed.meta["name"])


@dataclass
class MixedJob:
    """The evaluate-mixed stage's config: the allocation's knobs, the evaluation's, and the options whole."""
    layer_policy: LayerPolicyConfig
    eval: EvalConfig
    options: list[QuantConfig]


def mixed_name(cfg: LayerPolicyConfig) -> str:
    return f"mixed-{cfg.budget:g}b"


def _fit_mixed(ctx: Context, inputs: dict, job: MixedJob, progress) -> StageResult:
    """Sensitivity of each option on calibration windows -> greedy allocation -> the mixed policy, evaluated as a
    whole on the evaluation windows (isolated effects interact)."""
    recipes = inputs["evaluate"].meta["recipes"]
    options = [Option(q.name, recipes[q.name]["avg_bits"], inputs[f"sensitivity-calib-{q.name}"].tensors["kl"][2])
               for q in job.options]
    choice = fit(options, job.layer_policy)
    name = mixed_name(job.layer_policy)
    mixed = assemble([recipe_policy(q, ctx.spec.n_layers, inputs) for q in job.options],
                     choice.tensors["choice"].tolist(), name)
    ev = evaluate.fit(evaluate.Inputs(ctx.model, ctx.spec, ctx.eval, [mixed]), job.eval, progress)
    return StageResult({"choice": choice.tensors["choice"], **ev.tensors},
                       {"name": name, "layer_policy": choice.meta, "recipe": ev.meta["recipes"][name]})


MIXED = Declaration("evaluate-mixed", MixedJob, _fit_mixed,
                    inputs=lambda j: ["evaluate", *(f"sensitivity-calib-{q.name}" for q in j.options),
                                      *inputs_of(j.options)],
                    units=eval_units)
