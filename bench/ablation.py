"""Ablation of SmoothAttention (QServe) and the outlier-token prefix (PrefixQuant / IntactKV) on top of the
KVQuant 3-bit recipe and of naive per-token int4, in one run on the bench.quality protocol.

Protocol (bench.quality): calibrate on wikitext-2 valid.txt (16 windows x 1024 tokens, seed 0), evaluate on the
first 16 consecutive non-overlapping 1024-token windows of test.txt. KL is always against plain fp16 on the
window; `fp16+prefix` shows what the prefix alone does to the text's distribution.

python -m bench.ablation --json PATH [--n-samples 16 --seq-len 1024 --eval-n-samples 16]
"""
from __future__ import annotations

import argparse

from bench.common import write_json
from bench.quality import add_protocol_args, run_protocol
from pipeline.config import load_recipe

ROWS = ["fp16", "fp16+prefix", "kvquant-3b-1pct", "kvquant-3b-1pct+smooth", "kvquant-3b-1pct+prefix",
        "kvquant-3b-1pct+smooth+prefix", "int4-token", "int4-token+smooth"]


def prefix_strings(ids: list[int], tokenizer) -> list[str]:
    return [repr(tokenizer.decode([i])) for i in ids]


def table(rows: dict[str, dict], reference: str = "fp16") -> str:
    width = max(len(n) for n in rows) + 2
    head = (f"{'recipe':<{width}} {'avg_bits':>8} {'ppl':>9} {'ppl/fp16':>9} {'95% interval':>17} {'KL':>8} "
            f"{'top1':>7} {'prefix':>6}")
    lines = [head, "-" * len(head)]
    for name, r in rows.items():
        interval = "[{:.4f}, {:.4f}]".format(*r["ppl_ratio_ci95"])
        lines.append(f"{name:<{width}} {r['avg_bits']:>8.3f} {r['ppl']:>9.3f} {r['ppl_ratio']:>9.4f} {interval:>17} "
                     f"{r['kl']:>8.4f} {r['top1']:>7.4f} {r['prefix_tokens']:>6d}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    add_protocol_args(ap)
    ap.add_argument("--recipes", default=",".join(ROWS))
    args = ap.parse_args()
    names = args.recipes.split(",")
    out = run_protocol(names, args)
    summary, tokenizer = out["summary"], out["model"].tokenizer
    evaluated = summary["evaluation"]["recipes"]
    prefix = summary["stage_meta"]["prefix_tokens"]
    smooth = summary["stage_meta"]["smooth"]
    rows = {}
    for name in names:
        r = evaluated[name]
        n_prefix = prefix["prefix_len"] if load_recipe(name).prefix else 0
        rows[name] = {"ppl": r["ppl"], "kl": r["kl"], "avg_bits": r["avg_bits"], "top1": r["top1"],
                      "ppl_ratio": r["ppl_ratio"], "ppl_ratio_ci95": r["ppl_ratio_ci95"], "prefix_tokens": n_prefix}
    strings = prefix_strings(prefix["ids"], tokenizer)
    print()
    print(table(rows))
    print(f"prefix ({prefix['prefix_len']} tokens, ids {prefix['ids']}): {' '.join(strings)}")
    print(f"  discovered n = {prefix['n_found']} (eta {prefix['eta']}, cap {prefix['max_tokens']}, used "
          f"{prefix['n_used']} outlier tokens + BOS); outlier layer {prefix['outlier_layer']}, mean outliers per "
          f"sample there {max(prefix['mean_outliers_per_layer']):.3f}; saturated (sample, layer) pairs "
          f"{prefix['saturated']}")
    freq = ", ".join(f"{repr(tokenizer.decode([int(t)]))}x{c}" for t, c in prefix["frequency"].items())
    print(f"  most frequent outlier tokens (position > 0, counted over samples x layers): {freq or 'none'}")
    print(f"smooth lambda: alpha {smooth['alpha']}, beta {smooth['beta']}, range [{smooth['lambda_min']:.4g}, "
          f"{smooth['lambda_max']:.4g}], unit pairs {smooth['unit_pairs']}")
    print(f"calibration wall: {summary['calib_wall_s']:.1f} s, total {summary['wall_s']:.1f} s")
    write_json(args.json, {"rows": rows, "prefix": {"ids": prefix["ids"], "tokens": strings,
                                                    "tokenizer_sha256": prefix["tokenizer_sha256"],
                                                    "n_found": prefix["n_found"], "eta": prefix["eta"]},
                           "smooth": smooth, "calib_wall_s": summary["calib_wall_s"]})


if __name__ == "__main__":
    main()
