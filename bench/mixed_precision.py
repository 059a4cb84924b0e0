"""Mixed precision per layer vs the best uniform recipe at the same average-bits budget.

Same data protocol as bench.quality. The layer policy is chosen from per-layer sensitivity measured on
calibration windows (valid.txt), then the whole stack is evaluated on the test windows beside every uniform
recipe.

python -m bench.mixed_precision --budget 3.0 --json PATH
"""
from __future__ import annotations

import argparse

from bench.common import write_json
from bench.quality import RECIPES, add_protocol_args, protocol_config, run_protocol
from pipeline.config import LayerPolicyConfig
from stages.evaluate import table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--budget", type=float, default=3.0)
    ap.add_argument("--options", default="kvquant-2b-1pct,kvquant-3b-1pct,kvquant-4b-1pct")
    ap.add_argument("--sensitivity-windows", type=int, default=1)
    add_protocol_args(ap)
    args = ap.parse_args()
    cfg = protocol_config(RECIPES, args)
    cfg.layer_policy = LayerPolicyConfig(enabled=True, budget=args.budget, options=args.options.split(","),
                                         n_windows=args.sensitivity_windows)
    out = run_protocol(RECIPES, args, cfg)
    s = out["summary"]
    recipes = s["evaluation"]["recipes"]
    mixed_name = f"mixed-{args.budget:g}b"
    mixed = recipes[mixed_name]
    uniform = {n: r for n, r in recipes.items() if n != mixed_name and r["avg_bits"] <= args.budget}
    best = min(uniform, key=lambda n: uniform[n]["ppl"])
    print()
    print(table(recipes))
    choice = s["mixed"]["layer_policy"]["choice"]
    print(f"bits per layer ({mixed_name}): {[c.split('-')[1] for c in choice]}")
    print(f"best uniform recipe at <= {args.budget} bits: {best} ppl {uniform[best]['ppl']:.3f} at "
          f"{uniform[best]['avg_bits']:.3f} bits; mixed ppl {mixed['ppl']:.3f} at {mixed['avg_bits']:.3f} bits -> "
          f"{'mixed wins' if mixed['ppl'] < uniform[best]['ppl'] else 'uniform wins'}")
    bits = [float(c.split("-")[1].rstrip("b")) for c in choice]
    write_json(args.json, {"uniform": {"name": best, "ppl": uniform[best]["ppl"], "avg_bits": uniform[best]["avg_bits"]},
                           "mixed": {"ppl": mixed["ppl"], "avg_bits": mixed["avg_bits"], "bits_per_layer": bits}})


if __name__ == "__main__":
    main()
