"""The fused CPU decode kernel alone (serving/csrc/decode_attention.c), at SmolLM2-135M's attention shape: time per
layer and call, by format and thread count, and the output's distance from the oracle.

    python -m bench.cpu_kernel [--context 8000] [--formats nuq4-1pct,nuq2-1pct,nuq3-1pct] [--threads 1,2]
                               [--reps 50] [--general] [--json PATH]

One layer (9 query heads, 3 kv heads, head_dim 64, RoPE theta 100000 as SmolLM2), one new token per sequence,
a random cache of --context rows laid out as serving/cache.py stores them: keys pre-RoPE per channel through a
2^bits-level codebook (rotated at their positions in the kernel), values per token, --outliers of each row's
entries as sparse outliers on both sides (the default recipe's 1%), one fp16 sink row. Per (format, threads):
- kernel_ms: the median wall time of --reps calls of the library's kvcalib_decode alone, on the buffers
  serving.cpu_attention.decode_attention prepared, after 3 unmeasured ones; the cache is warm (it fits in L2 at 8k);
- call_ms: the whole decode_attention (its host preparation of the pages, per call, included: the serving cache's
  cost, not the vLLM plugin's, which keeps its page tables per step);
- ns_per_head_row: kernel_ms over context x kv heads;
- max_rel_err: against runtime_check/reference.py's decode_attention on the same inputs.
--general: every page through the library's general path (serving.cpu_attention.fused_path(False); the same as
KVCALIB_KERNEL_FUSED=0), whose output the fused path equals bit for bit -- the A/B of the fused path.
The figure a kernel change is judged by; the engine's decode figure is bench.vllm_decode's.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

H_Q, H_KV, D = 9, 3, 64


def _rotary():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    cfg = LlamaConfig(hidden_size=H_Q * D, num_attention_heads=H_Q, num_key_value_heads=H_KV, head_dim=D,
                      max_position_embeddings=8192, rope_theta=100000.0)
    return LlamaRotaryEmbedding(cfg)


def make_inputs(fmt: str, t: int, fraction: float, seed: int = 0):
    """-> DecodeInputs over a random stored cache of t rows (one fp16 sink row, t - 1 encoded)."""
    from exporters.codec import TensorPolicy
    from exporters.layout import StoredBlock
    from serving.inputs import DecodeInputs

    g = torch.Generator().manual_seed(seed)
    bits = int(fmt[3])
    frac = fraction if fmt.endswith("1pct") else 0.0
    book = torch.sort(torch.rand(2 ** bits, generator=g) * 2 - 1).values
    pk = TensorPolicy(format="nuq", bits=bits, axis="channel", outlier_fraction=frac, codebook=book,
                      zero=torch.randn(H_KV, D, generator=g) * 0.1, range=torch.rand(H_KV, D, generator=g) + 0.5,
                      lower=torch.full((H_KV, D), -1.0), upper=torch.full((H_KV, D), 1.0))
    pv = TensorPolicy(format="nuq", bits=bits, axis="token", outlier_fraction=frac, codebook=book.clone())
    n = t - 1

    def codes():
        return torch.randint(0, 256, (1, H_KV, n, D * bits // 8), generator=g, dtype=torch.uint8)

    def outliers():
        per_row = max(1, round(frac * H_KV * D))
        idx = torch.sort(torch.randint(0, H_KV * D, (n, per_row), generator=g), dim=1).values
        return {"outlier_count": torch.full((n, 1), per_row, dtype=torch.int16),
                "outlier_index": idx.reshape(-1).to(torch.int16),
                "outlier_value": torch.randn(n * per_row, generator=g).half() * 8}

    k_t = {"codes": codes()}
    v_t = {"codes": codes(), "scale": torch.rand(1, H_KV, n, 1, generator=g).half() + 0.5,
           "zero": torch.randn(1, H_KV, n, 1, generator=g).half() * 0.1}
    if frac:
        k_t |= outliers()
        v_t |= outliers()
    sink = tuple(torch.randn(1, H_KV, 1, D, generator=g).half() for _ in range(2))
    q = torch.randn(1, H_Q, D, generator=g)
    return DecodeInputs(q=q, scaling=D ** -0.5, key_policy=pk, value_policy=pv, key_rope="pre", rotary=_rotary(),
                        sink=sink, k_block=StoredBlock(1, (1, H_KV, n, D), k_t),
                        v_block=StoredBlock(1, (1, H_KV, n, D), v_t))


class _Timed:
    """The loaded library with its kvcalib_decode run `reps` times per call (after 3 unmeasured), each timed: the
    kernel alone, on the call's own buffers while the caller holds them."""

    def __init__(self, lib, reps: int) -> None:
        self.lib, self.reps, self.times = lib, reps, []

    def __getattr__(self, name):
        return getattr(self.lib, name)

    def kvcalib_decode(self, call, chunk, threads, out):
        for _ in range(3):
            rc = self.lib.kvcalib_decode(call, chunk, threads, out)
        for _ in range(self.reps):
            t0 = time.perf_counter()
            rc = self.lib.kvcalib_decode(call, chunk, threads, out)
            self.times.append(time.perf_counter() - t0)
        return rc


def kernel_ms(inp, threads: int, reps: int) -> tuple[float, torch.Tensor]:
    """The median wall time of the library's call alone, in ms, and the output."""
    from serving import cpu_attention

    lib = cpu_attention._load()
    timed = _Timed(lib, reps)
    cpu_attention._LIB["lib"] = timed
    try:
        out = cpu_attention.decode_attention(inp, threads=threads)
    finally:
        cpu_attention._LIB["lib"] = lib
    return 1000 * statistics.median(timed.times), out


def measure(formats: list[str], context: int, threads: list[int], reps: int, fraction: float) -> list[dict]:
    from runtime_check import reference
    from serving import cpu_attention

    rows = []
    for fmt in formats:
        inp = make_inputs(fmt, context, fraction)
        ref = reference.decode_attention(inp)
        for n in threads:
            ms, out = kernel_ms(inp, n, reps)
            times = []
            for _ in range(max(3, reps // 5)):
                t0 = time.perf_counter()
                cpu_attention.decode_attention(inp, threads=n)
                times.append(time.perf_counter() - t0)
            call = 1000 * statistics.median(times)
            err = float((out - ref).abs().max() / ref.abs().max())
            rows.append({"format": fmt, "threads": n, "context": context, "kernel_ms": ms, "call_ms": call,
                         "ns_per_head_row": 1e6 * ms / (context * H_KV), "max_rel_err": err})
            print(f"{fmt:>10} threads {n}  kernel {ms:7.3f} ms ({rows[-1]['ns_per_head_row']:5.1f} ns/head-row)  "
                  f"whole call {call:7.3f} ms  max_rel_err {err:.1e}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=8000)
    ap.add_argument("--formats", default="nuq4-1pct,nuq2-1pct,nuq3-1pct",
                    help="comma-separated nuqB or nuqB-1pct (B in 2, 3, 4)")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--outliers", type=float, default=0.01, help="fraction of a row's entries (the -1pct formats)")
    ap.add_argument("--general", action="store_true", help="the library's general path only (no fused path)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    import os

    from serving import cpu_attention

    if not cpu_attention.available():
        print(f"bench.cpu_kernel: the CPU kernel is not available: {cpu_attention.status().get('reason')}")
        return 1
    formats = [f for f in args.formats.split(",") if f]
    bad = [f for f in formats if not (len(f) >= 4 and f[:3] == "nuq" and f[3] in "234" and f[4:] in ("", "-1pct"))]
    if bad:
        ap.error(f"--formats: allowed nuq2, nuq3, nuq4, each optionally with -1pct; got {bad}")
    torch.manual_seed(0)
    general = args.general or os.environ.get("KVCALIB_KERNEL_FUSED") == "0"
    path = "general" if general else "fused"
    print(f"bench.cpu_kernel: SmolLM2 attention shape (H_q {H_Q}, H_kv {H_KV}, D {D}), {args.context} rows, "
          f"{path} path, kernel {cpu_attention.status().get('path', '')}", flush=True)
    cpu_attention.fused_path(not general)
    try:
        rows = measure(formats, args.context, [int(x) for x in args.threads.split(",")], args.reps, args.outliers)
    finally:
        cpu_attention.fused_path(True)
    if args.json:
        from bench.common import write_json

        write_json(args.json, {"context": args.context, "path": path, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
