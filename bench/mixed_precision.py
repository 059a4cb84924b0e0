"""Mixed precision per layer vs the best uniform recipe at the same average-bits budget.

Same data protocol as bench.quality. The layer policy is chosen from per-layer sensitivity measured on
calibration windows (valid.txt), then the whole stack is evaluated on the test windows beside every uniform
recipe (or those named by --recipes). Each is compared on its perplexity ratio to fp16 on the same windows
with the 95% interval (over windows and perturbation seeds, as in bench.quality): the mixed stack wins only
when its interval lies below the best uniform recipe's.

python -m bench.mixed_precision --budget 3.0 --json PATH
"""
from __future__ import annotations

import argparse

from bench.common import write_json
from bench.quality import OURS, add_protocol_args, protocol_config, run_protocol
from pipeline.config import LayerPolicyConfig
from stages.evaluate import table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--budget", type=float, default=3.0)
    ap.add_argument("--options", default="kvquant-2b-1pct,kvquant-3b-1pct,kvquant-4b-1pct")
    ap.add_argument("--sensitivity-windows", type=int, default=1)
    ap.add_argument("--recipes", default=",".join(OURS), help="uniform recipes evaluated beside the mixed stack")
    add_protocol_args(ap)
    args = ap.parse_args()
    names = args.recipes.split(",")
    cfg = protocol_config(names, args)
    cfg.layer_policy = LayerPolicyConfig(enabled=True, budget=args.budget, options=args.options.split(","),
                                         n_windows=args.sensitivity_windows)
    out = run_protocol(names, args, cfg)
    s = out["summary"]
    recipes = s["evaluation"]["recipes"]
    mixed_name = f"mixed-{args.budget:g}b"
    mixed = recipes[mixed_name]
    uniform = {n: r for n, r in recipes.items() if n != mixed_name and r["avg_bits"] <= args.budget}
    if not uniform:
        raise SystemExit(f"--recipes: none of {names} fits the budget of {args.budget} bits")
    best = min(uniform, key=lambda n: uniform[n]["ppl_ratio"])
    print()
    print(table(recipes))
    choice = s["mixed"]["layer_policy"]["choice"]
    print(f"bits per layer ({mixed_name}): {[c.split('-')[1] for c in choice]}")
    (m_lo, m_hi), (u_lo, u_hi) = mixed["ppl_ratio_ci95"], uniform[best]["ppl_ratio_ci95"]
    verdict = ("mixed wins (intervals apart)" if m_hi < u_lo else "uniform wins (intervals apart)" if u_hi < m_lo
               else "intervals overlap: no winner")
    print(f"best uniform recipe at <= {args.budget} bits: {best} ppl/fp16 {uniform[best]['ppl_ratio']:.4f} "
          f"[{u_lo:.4f}, {u_hi:.4f}] at {uniform[best]['avg_bits']:.3f} bits; {mixed_name} ppl/fp16 "
          f"{mixed['ppl_ratio']:.4f} [{m_lo:.4f}, {m_hi:.4f}] at {mixed['avg_bits']:.3f} bits -> {verdict}")
    bits = [float(c.split("-")[1].rstrip("b")) for c in choice]
    keys = ("ppl", "ppl_ratio", "ppl_ratio_ci95", "avg_bits")
    write_json(args.json, {"uniform": {"name": best, **{k: uniform[best][k] for k in keys}},
                           "mixed": {"name": mixed_name, **{k: mixed[k] for k in keys}, "bits_per_layer": bits},
                           "verdict": verdict})


if __name__ == "__main__":
    main()
