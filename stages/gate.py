"""The drift gate: thresholds on the worst cell, not the average. A run whose artifact crosses one
fails, naming the offending cell."""
from __future__ import annotations

from dataclasses import dataclass

from stages.base import StageResult


@dataclass
class GateConfig:
    enabled: bool = True
    max_ppl_ratio: float = 1.05        # recipe perplexity / fp16 perplexity
    max_cell_kl: float = 0.05          # layer x position map: next-token KL with one layer quantized
    min_cell_cos: float = 0.95         # layer x position map: attention-output cosine similarity
    min_passkey_ratio: float = 1.0     # passkey accuracy / fp16 passkey accuracy


@dataclass
class Inputs:
    recipe: str
    evaluation: dict                   # {recipe: {ppl, ...}} (the evaluate stage)
    sensitivity: dict | None = None    # {"map_kl": [[...]], "map_cos": [[...]], "bucket_edges": [...]}
    passkey: dict | None = None        # {"fp16": acc, recipe: acc}
    long: dict | None = None           # the evaluate-long stage's meta (recipes, seq_len, windows), when run


def fit(inputs: Inputs, cfg: GateConfig) -> StageResult:
    """-> meta {"passed": bool, "failures": [...], "thresholds": {...}}"""
    return StageResult({}, check(cfg, inputs.recipe, inputs.evaluation, inputs.sensitivity, inputs.passkey,
                                 inputs.long))


def _ppl_ratio(evaluation: dict, recipe: str, where: str) -> float:
    row = evaluation.get(recipe)
    if row is None:
        raise ValueError(f"gate: recipe {recipe!r} was not evaluated{where} (evaluated: {sorted(evaluation)})")
    ratio = row.get("ppl_ratio")  # to the full-precision model on the same windows (stages.evaluate)
    if ratio is None:
        raise ValueError(f"gate: the evaluation{where} of {recipe!r} has no ppl_ratio to fp16; the perplexity check "
                         f"cannot be judged")
    return ratio


def check(cfg: GateConfig, recipe: str, evaluation: dict, sensitivity: dict | None, passkey: dict | None,
          long: dict | None = None) -> dict:
    """The perplexity ratio is always judged, on the evaluation windows and (when the run has them) on the
    long-context windows: an evaluation that lacks the recipe or its ppl_ratio raises ValueError (stages.evaluate
    gives every recipe one, fp16 in eval.recipes or not, so this is a broken invariant, never a pass). The cell
    maps and passkey accuracy are judged when given."""
    failures = []
    ratio = _ppl_ratio(evaluation, recipe, "")
    if ratio > cfg.max_ppl_ratio:
        failures.append(f"perplexity ratio {ratio:.4f} > max_ppl_ratio {cfg.max_ppl_ratio}")
    if long is not None:
        where = f" at long context ({long['windows']} x {long['seq_len']} tokens)"
        ratio = _ppl_ratio(long["recipes"], recipe, where)
        if ratio > cfg.max_ppl_ratio:
            failures.append(f"perplexity ratio{where} {ratio:.4f} > max_ppl_ratio {cfg.max_ppl_ratio}")
    if sensitivity:
        edges = sensitivity["bucket_edges"]
        names = [f"{a}-{b}" for a, b in zip(edges, edges[1:])] + [f"{edges[-1]}+"]
        for layer, (kls, coss) in enumerate(zip(sensitivity["map_kl"], sensitivity["map_cos"])):
            for j, (kl, cos) in enumerate(zip(kls, coss)):
                if kl > cfg.max_cell_kl:
                    failures.append(f"layer {layer} positions {names[j]}: KL {kl:.4f} > max_cell_kl {cfg.max_cell_kl}")
                if cos < cfg.min_cell_cos:
                    failures.append(f"layer {layer} positions {names[j]}: attention cosine {cos:.4f} < "
                                    f"min_cell_cos {cfg.min_cell_cos}")
    if passkey and passkey.get("fp16"):
        ratio = passkey.get(recipe, 0.0) / passkey["fp16"]
        if ratio < cfg.min_passkey_ratio:
            failures.append(f"passkey accuracy {passkey.get(recipe, 0.0):.2f} vs fp16 {passkey['fp16']:.2f} "
                            f"(ratio {ratio:.2f} < min_passkey_ratio {cfg.min_passkey_ratio})")
    return {"passed": not failures, "failures": failures,
            "thresholds": {k: getattr(cfg, k) for k in ("max_ppl_ratio", "max_cell_kl", "min_cell_cos", "min_passkey_ratio")}}
