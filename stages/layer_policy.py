"""Mixed precision per layer under an average-bits budget (QAQ / KVTuner-style allocation by sensitivity).

Inputs: for every candidate option (a recipe of one family, e.g. kvquant-{2,3,4}b-1pct with the same windows, or
ones that give keys and values different bits) the isolated per-layer KL (only that layer quantized, measured on
calibration windows) and the bits each layer holds under it, as the ledger predicts them for a sequence of
`seq_len` tokens (exporters/ledger.py: codes, scales, sink and recent rows, the recipe's nominal outlier fraction,
static tensors; a sliding layer's window). Nothing of the evaluation text enters the choice. Greedy by sensitivity
per bit saved on each layer's lower convex hull: start every layer at its most precise option and repeatedly take,
over all layers, the move to a cheaper option of that layer that costs the least KL per bit saved, until the
average fits the budget. The sum of isolated KLs is only a proxy -- the chosen stack is evaluated as a whole
afterwards, and its bits are the ledger's over what it held, as every recipe's.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from exporters.codec import CachePolicy
from exporters.ledger import layer_bytes
from exporters.served_rows import layer_rows
from stages import evaluate
from stages.base import Context, Declaration, InputError, StageResult, eval_units
from stages.evaluate import EvalConfig
from stages.recipe import QuantConfig, inputs_of, recipe_policy


@dataclass
class Option:
    name: str
    bits: float | torch.Tensor  # average bits per element: one figure, or [n_layers] over each layer's held elements
    kl: torch.Tensor            # [n_layers] isolated KL with only that layer on this option


def choose(options: list[Option], budget: float, weights: torch.Tensor | None = None,
           allowed: torch.Tensor | None = None) -> list[int]:
    """-> the index (into `options`) of each layer's option. weights [n_layers]: each layer's share of the cache's
    elements (None: equal shares); the average bits are sum_i weights[i] * bits of layer i's option. allowed
    [n_options, n_layers] bool: the options each layer may take (None: all; every layer needs one)."""
    if not options:
        raise InputError("layer_policy needs at least one option")
    n_layers = options[0].kl.numel()
    bits = torch.stack([torch.as_tensor(o.bits, dtype=torch.float64).expand(n_layers) for o in options])  # [O, L]
    kl = torch.stack([o.kl.double() for o in options])
    ok = torch.ones_like(bits, dtype=torch.bool) if allowed is None else allowed.bool()
    if not bool(ok.any(0).all()):
        raise InputError(f"layer_policy: layers {(~ok.any(0)).nonzero().flatten().tolist()} are allowed no option")
    w = torch.full((n_layers,), 1.0 / n_layers, dtype=torch.float64) if weights is None else weights.double()
    bits_ok = bits.masked_fill(~ok, float("inf"))
    cheapest = float((w * bits_ok.min(0).values).sum())
    if budget < cheapest - 1e-12:
        names = sorted({options[int(j)].name for j in bits_ok.argmin(0)})
        msg = f"budget {budget} bits is below the cheapest option {', '.join(names)} ({cheapest:.3f} bits)"
        held = (~ok).any(0)
        free = float((w * bits.min(0).values).sum())
        if bool(held.any()) and free < cheapest - 1e-12:
            msg += (f"; layers {held.nonzero().flatten().tolist()} may take only layer_policy.full_context_options, "
                    f"which sets that floor (without it the cheapest is {free:.3f} bits): raise the budget, or "
                    f"widen or empty layer_policy.full_context_options")
        raise InputError(msg)
    # each layer starts at its most precise allowed option (ties: the lower KL)
    cur = [max((j for j in range(len(options)) if ok[j, i]), key=lambda j: (float(bits[j, i]), -float(kl[j, i])))
           for i in range(n_layers)]
    avg = lambda: float(sum(w[i] * bits[c, i] for i, c in enumerate(cur)))  # noqa: E731
    while avg() > budget + 1e-12:
        best, best_cost = None, float("inf")
        for i, c in enumerate(cur):
            for j in range(len(options)):
                saved = float(w[i] * (bits[c, i] - bits[j, i]))
                if saved <= 1e-12 or not ok[j, i]:
                    continue
                cost = float(kl[j, i] - kl[c, i]) / saved
                if cost < best_cost:
                    best, best_cost = (i, j), cost
        if best is None:
            break
        cur[best[0]] = best[1]
    return cur


def layer_bits(policy: CachePolicy, spec, t: int) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (bits [n_layers]: average bits per held element of each layer, elements [n_layers]: the K and V elements
    each layer holds) for a sequence of t tokens, as the ledger predicts them (the recipe's nominal outlier
    fraction; a sliding layer holds at most its window)."""
    h, d = spec.n_kv_heads, spec.head_dim
    bits, elements = [], []
    for i, (pk, pv) in enumerate(policy.layers):
        rows = layer_rows(policy, i, spec.layer_windows()[i])
        held = rows.held(t)
        n = 2 * (held.n_encoded + held.n_full_precision) * h * d
        bits.append(8 * layer_bytes(rows, pk, pv, t, h, d) / max(n, 1))
        elements.append(n)
    return torch.tensor(bits, dtype=torch.float64), torch.tensor(elements, dtype=torch.float64)


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
    # the sequence length the budget's bits are counted at (the ledger's prediction, sinks and recent rows
    # included); 0: the evaluation window (data.eval_seq_len)
    seq_len: int = 0
    # options a full-context layer (one without a sliding window: all of a Llama's, Gemma 3's global layers) may
    # take, each one of `options`; empty: all of them. The KL is measured on calibration windows shorter than the
    # served sequence, where a full-context layer's reach is not seen: retrieval at 8k rests on those layers.
    full_context_options: list[str] = field(default_factory=list)
    # each option also evaluated alone, its row beside the mixed policy's in the evaluation table (the choice
    # does not read it)
    evaluate_options: bool = True

    # not in the cache key: with enabled=false the layer-policy stages are not in the graph at all
    KEY_EXCLUDED: ClassVar[dict[str, str]] = {
        "enabled": "whether the stages run, not what they compute",
        "evaluate_options": "which rows the evaluation table holds, not what the allocation computes"}


def unknown_full_context(names: list[str], full_context_options: list[str]) -> str | None:
    """The refusal of full_context_options outside the options (None: each is one of them); the run's early check
    (pipeline/config.py) and the stage called as a library raise it."""
    unknown = sorted(set(full_context_options) - set(names))
    if not unknown:
        return None
    return f"layer_policy.full_context_options must each be one of layer_policy.options {list(names)}, got {unknown}"


def allowed_options(names: list[str], cfg: LayerPolicyConfig, windows: list[int | None]) -> torch.Tensor:
    """-> [n_options, n_layers] bool: which option each layer may take (windows: per layer its sliding window,
    None for a full-context layer)."""
    ok = torch.ones(len(names), len(windows), dtype=torch.bool)
    if cfg.full_context_options:
        if (msg := unknown_full_context(names, cfg.full_context_options)) is not None:
            raise InputError(msg)
        for i, window in enumerate(windows):
            if window is None:
                ok[:, i] = torch.tensor([n in cfg.full_context_options for n in names])
    return ok


def fit(options: list[Option], cfg: LayerPolicyConfig, weights: torch.Tensor | None = None,
        windows: list[int | None] | None = None) -> StageResult:
    """options: one per candidate recipe (isolated per-layer KL and bits) -> the choice per layer. windows: per
    layer its sliding window or None (full context; None for the list: every layer)."""
    budget = cfg.budget
    n_layers = options[0].kl.numel() if options else 0
    allowed = allowed_options([o.name for o in options], cfg, windows or [None] * n_layers)
    choice = choose(options, budget, weights, allowed)
    w = torch.full((n_layers,), 1.0 / n_layers, dtype=torch.float64) if weights is None else weights.double()
    per_layer = [torch.as_tensor(o.bits, dtype=torch.float64).expand(n_layers) for o in options]
    predicted = float(sum(w[i] * per_layer[c][i] for i, c in enumerate(choice)))
    return StageResult({"choice": torch.tensor(choice)},
                       {"budget": budget, "options": [o.name for o in options],
                        "option_bits": [float((w * b).sum()) for b in per_layer],
                        "choice": [options[c].name for c in choice], "predicted_avg_bits": predicted,
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
    """Sensitivity of each option on calibration windows and its bits as the ledger predicts them at
    layer_policy.seq_len -> greedy allocation -> the mixed policy, evaluated as a whole on the evaluation windows
    (isolated effects interact) against the evaluate-reference stage's hidden states."""
    t = job.layer_policy.seq_len or ctx.eval.shape[1]
    policies = [recipe_policy(q, ctx.spec.n_layers, inputs) for q in job.options]
    options, elements = [], None
    for q, p in zip(job.options, policies):
        bits, elements = layer_bits(p, ctx.spec, t)
        options.append(Option(q.name, bits, inputs[f"sensitivity-calib-{q.name}"].tensors["kl"][2]))
    choice = fit(options, job.layer_policy, elements / elements.sum(), ctx.spec.layer_windows())
    choice.meta["seq_len"] = int(t)
    name = mixed_name(job.layer_policy)
    mixed = assemble(policies, choice.tensors["choice"].tolist(), name)
    ev = evaluate.fit(evaluate.Inputs(ctx.model, ctx.spec, ctx.eval, [mixed]), job.eval, progress,
                      ref_hidden=inputs[evaluate.REFERENCE.name].tensors["hidden"])
    return StageResult({"choice": choice.tensors["choice"], **ev.tensors},
                       {"name": name, "layer_policy": choice.meta, "recipe": ev.meta["recipes"][name]})


MIXED = Declaration("evaluate-mixed", MixedJob, _fit_mixed,
                    inputs=lambda j: [evaluate.REFERENCE.name, *(f"sensitivity-calib-{q.name}" for q in j.options),
                                      *inputs_of(j.options)],
                    units=eval_units)
