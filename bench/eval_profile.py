"""Where one evaluated unit's time goes: per recipe, one evaluation window under one perturbation seed, timed in
parts beside one plain forward of the same window in the same run.

Parts (seconds per unit, inclusive; the attention's parts are summed over the model's layers):
  unit       the whole unit: the model under the recipe's cache (body) and the window's metrics
  body       the model's forward to its final hidden states with the recipe's attention
  attention  the recipe's attention function (stages.evaluate.quantized_attention / engine_attention), of which
    perturb    the cache-input perturbation (Perturbation)
    codec      encode -> decode (exporters.codec.fake_quant), of which
      outlier    per-token outlier bounds (token_outlier_bounds: the quantiles)
      levels     nearest-level search of the non-uniform codebooks (nearest_level: bucketize)
    rope       RoPE inverted before encoding and re-applied after decoding (pre-RoPE recipes)
    sdpa       the attention proper when every row is read encoded (torch SDPA)
    residual   the two-score attention of recipes that hold recent rows in fp16 (scores, masks, softmax, values)
  metrics    LM head, log-softmax, NLL, KL against the reference and top-1, chunk by chunk
The plain forward (model(ids).logits, the model's own attention) is the floor of a unit; unit / forward is
what the evaluation costs over the forwards it must do.

python -m bench.eval_profile --cache-dir DIR [--recipes a,b,...] [--json PATH]  (the protocol's calibration:
bench.quality's arguments; a cache dir bench.quality filled skips the calibration)
"""
from __future__ import annotations

import argparse
import time
from collections import defaultdict
from contextlib import contextmanager

import torch

from bench.common import write_json
from bench.quality import RECIPES, add_protocol_args, plain_forward_s, protocol_config, run_protocol

PARTS = ("body", "attention", "perturb", "codec", "outlier", "levels", "rope", "sdpa", "residual", "metrics")


@contextmanager
def timed_parts(totals: dict[str, float]):
    """Within the block the evaluation's parts add their wall time to totals[part]."""
    from exporters import codec
    from stages import evaluate

    def wrap(fn, part):
        def inner(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                totals[part] += time.perf_counter() - start
        return inner

    def wrap_factory(factory):
        def make(*args, **kwargs):
            return wrap(factory(*args, **kwargs), "attention")
        return make

    patches = [(evaluate, "fake_quant", "codec"), (codec, "token_outlier_bounds", "outlier"),
               (codec, "nearest_level", "levels"), (evaluate, "invert_rope", "rope"), (evaluate, "apply_rope", "rope"),
               (evaluate, "sdpa_attention", "sdpa"), (evaluate, "attention_scores", "residual"),
               (evaluate, "attend", "residual")]
    saved = [(mod, name, getattr(mod, name)) for mod, name, _ in patches]
    saved += [(evaluate, n, getattr(evaluate, n)) for n in ("quantized_attention", "engine_attention")]
    saved.append((evaluate.Perturbation, "__call__", evaluate.Perturbation.__call__))
    try:
        for mod, name, part in patches:
            setattr(mod, name, wrap(getattr(mod, name), part))
        evaluate.quantized_attention = wrap_factory(saved[-3][2])
        evaluate.engine_attention = wrap_factory(saved[-2][2])
        evaluate.Perturbation.__call__ = wrap(saved[-1][2], "perturb")
        yield
    finally:
        for mod, name, fn in saved:
            setattr(mod, name, fn)


def profile(out: dict, names: list[str], seed: int, scale: float) -> dict:
    """-> {recipe: {part: seconds}} for one unit each (the first evaluation window, perturbation seed `seed`)."""
    from stages import evaluate
    from stages.recipe import recipe_policy
    from stages.hooks import model_device
    from pipeline.config import load_recipe

    lm, results = out["model"], out["results"]
    ids = out["windows"].eval[:1].to(model_device(lm.model))  # where the model's inputs go (a GPU under cuda)
    rows = {}
    with torch.no_grad():
        ref_hidden = lm.model.model(ids, use_cache=False).last_hidden_state[0]
        metrics = evaluate._WindowMetrics(lm.model, ref_hidden, ids[0, 1:])
        for name in names:
            policy = recipe_policy(load_recipe(name), lm.spec.n_layers, results)
            totals: dict[str, float] = defaultdict(float)
            perturb = None if policy.is_full_precision else evaluate.Perturbation(
                scale, torch.Generator().manual_seed(1_000_003 * seed))
            with timed_parts(totals):
                start = time.perf_counter()
                hidden = evaluate.policy_hidden(lm.model, ids, policy, None, perturb)
                totals["body"] = time.perf_counter() - start
                mid = time.perf_counter()
                metrics.of(hidden)
                totals["metrics"] = time.perf_counter() - mid
                totals["unit"] = time.perf_counter() - start
            rows[name] = {p: totals.get(p, 0.0) for p in ("unit", *PARTS)}
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_protocol_args(ap)
    ap.add_argument("--recipes", default=",".join(RECIPES))
    args = ap.parse_args()
    names = args.recipes.split(",")
    out = run_protocol(names, args, protocol_config(names, args))
    forward = plain_forward_s(out["model"].model, out["windows"].eval[:1])
    rows = profile(out, names, seed=1, scale=args.perturb_scale)
    head = f"{'recipe':<26} {'unit/fwd':>8} " + " ".join(f"{p:>9}" for p in ("unit", *PARTS))
    print(f"\none plain forward of a {out['windows'].eval.shape[1]}-token window: {forward:.3f} s; "
          f"seconds per unit (one window, one seed):")
    print(head)
    print("-" * len(head))
    for name, r in rows.items():
        print(f"{name:<26} {r['unit'] / forward:8.3f} " + " ".join(f"{r[p]:9.3f}" for p in ("unit", *PARTS)))
    write_json(args.json, {"forward_s": forward, "seq_len": int(out["windows"].eval.shape[1]), "units": rows})


if __name__ == "__main__":
    main()
