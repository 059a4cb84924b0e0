"""Traces stage on wikitext-2 valid.txt: wall time (model load included) and peak RSS.

python -m bench.traces --model smollm2 --n-samples 16 --seq-len 1024 --json PATH
"""
from __future__ import annotations

import argparse
import time

from bench.common import wikitext_dir, write_json
from pipeline.config import DataConfig, ModelConfig, TracesConfig
from pipeline.data import random_windows, tokenize, read_text
from pipeline.model import load_model
from pipeline.runner import peak_rss_mb
from stages import traces


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="smollm2", choices=["smollm2", "tiny"])
    ap.add_argument("--n-samples", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--reservoir", type=int, default=TracesConfig.reservoir_size)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    start = time.perf_counter()
    source = "embedded" if args.model == "smollm2" else "tiny"
    lm = load_model(ModelConfig(name=args.model, source=source))
    ids = tokenize(lm.tokenizer, read_text(wikitext_dir() / "valid.txt", DataConfig.text_field))
    windows = random_windows(ids, args.n_samples, args.seq_len, seed=0)
    result = traces.fit(traces.Inputs(lm.model, lm.spec, windows), TracesConfig(reservoir_size=args.reservoir))
    wall = time.perf_counter() - start
    payload = {"wall_s": round(wall, 2), "peak_rss_mb": round(peak_rss_mb(), 1), "tokens": int(windows.numel())}
    print(f"traces {args.model} {args.n_samples}x{args.seq_len}: wall {payload['wall_s']} s (model load included), "
          f"peak RSS {payload['peak_rss_mb']} MB, {payload['tokens']} tokens, "
          f"reservoir {result.meta['reservoir_rows']} rows")
    write_json(args.json, payload)


if __name__ == "__main__":
    main()
