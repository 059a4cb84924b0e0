"""Where a decode step's time goes: bench.serve_memory's artifact row (prefill in chunks, then single-token steps
through the block-wise serving attention and the fused CPU kernel) with cProfile around the timed steps.

    python -m bench.decode_profile --artifact DIR --context 16384 --steps 24 [--top 30]

Prints the prefill time, the median step (under the profiler: a diagnostic, not a figure to compare with
serve_memory's) and the functions by their own time: `cpu_attention.launch` is the C kernel's call, `linear` the
model's matmuls, the rest the Python around them. The first --warmup steps are not profiled.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time

import torch

from bench import serve_memory


def profile(artifact: str | None, recipe: str | None, model: str, context: int, steps: int, warmup: int,
            chunk: int) -> tuple[float, list[float], pstats.Stats]:
    argv = ["--model", model, "--contexts", str(context), "--batches", "1", "--caches", "artifact",
            "--dtypes", "float32", "--quality-contexts", "", "--passkey-lengths", "", "--chunk", str(chunk)]
    args = serve_memory.parse(argv + (["--artifact", artifact] if artifact else ["--recipe", recipe]))
    args.dtype = "float32"
    lm, policy = serve_memory.load(args)
    ids = serve_memory.windows(lm.tokenizer, 1, context + steps)
    prof, times = cProfile.Profile(), []
    with serve_memory.positions_for(lm.model, context + steps), torch.no_grad():
        cache = serve_memory.make_cache("artifact", lm.model, policy, args.block, args.page)
        with serve_memory.served("artifact", lm.model, cache):
            start = time.perf_counter()
            serve_memory.prefill(lm.model, cache, ids, context, chunk)
            prefill_s = time.perf_counter() - start
            for i in range(steps):
                token = ids[:, context + i:context + i + 1]
                if i < warmup:
                    lm.model(token, cache=cache, use_cache=True)
                    continue
                t0 = time.perf_counter()
                prof.enable()
                lm.model(token, cache=cache, use_cache=True)
                prof.disable()
                times.append(time.perf_counter() - t0)
    return prefill_s, times, pstats.Stats(prof)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--artifact", default=None)
    ap.add_argument("--recipe", default=None, help="without --artifact: a calibration-free recipe")
    ap.add_argument("--model", default="embedded", choices=["embedded", "tiny"])
    ap.add_argument("--context", type=int, default=16384)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--top", type=int, default=30)
    a = ap.parse_args(argv)
    if not (a.artifact or a.recipe):
        ap.error("give --artifact DIR (or --recipe NAME)")
    if not 0 <= a.warmup < a.steps:
        ap.error(f"--warmup must be in [0, --steps), got {a.warmup} with --steps {a.steps}")
    prefill_s, times, stats = profile(a.artifact, a.recipe, a.model, a.context, a.steps, a.warmup, a.chunk)
    out = io.StringIO()
    stats.stream = out
    stats.sort_stats("tottime").print_stats(a.top)
    print(f"prefill {prefill_s:.2f} s; {len(times)} profiled steps, median {1000 * statistics.median(times):.1f} ms "
          f"(under the profiler)")
    print(out.getvalue())


if __name__ == "__main__":
    main()
