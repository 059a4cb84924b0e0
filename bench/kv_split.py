"""Where a recipe's loss comes from: the whole stack evaluated with only its keys quantized, then only its values.

Same protocol as bench.quality (`--dev` for the development split: both halves of valid.txt). Each row is one
pipeline run whose own recipe is the named one with the other tensor kept in full precision; the calibration
stages are shared through the stage cache.

python -m bench.kv_split --dev --eval-n-samples 8 --recipes kvquant-4b-1pct,kvquant-3b-1pct,kvquant-2b-1pct
"""
from __future__ import annotations

import argparse
import dataclasses

from bench.common import write_json
from bench.quality import add_protocol_args, protocol_config, run_protocol
from pipeline.config import TensorQuantConfig, load_recipe
from stages.evaluate import table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    add_protocol_args(ap)
    ap.add_argument("--recipes", default="kvquant-4b-1pct,kvquant-3b-1pct,kvquant-2b-1pct")
    args = ap.parse_args()
    rows: dict[str, dict] = {}
    for base in args.recipes.split(","):
        for part, keep in (("k only", "value"), ("v only", "key")):
            cfg = protocol_config(["fp16", base] if part == "k only" else ["fp16"], args)  # the whole recipe once
            q = load_recipe(base)
            cfg.quant = dataclasses.replace(q, name=f"{base}[{part}]", **{keep: TensorQuantConfig()})
            rows.update(run_protocol([], args, cfg)["summary"]["evaluation"]["recipes"])
            print(table(rows), flush=True)
    write_json(args.json, {"recipes": rows})


if __name__ == "__main__":
    main()
