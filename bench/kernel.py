"""Decode attention from the stored cache (the Triton kernel) vs torch SDPA on fp16 K/V: time per step and bytes read.

python -m bench.kernel [--contexts 4096,16384,65536,131072] [--batches 1,8] [--json PATH]    # on a CUDA GPU
python -m bench.kernel --cpu [--contexts 256] [--batches 1,2]     # dry run: Triton interpreted, wall-clock times

One layer of the Llama-3-8B attention shape (32 query heads, 8 kv heads, head_dim 128, Llama-3 RoPE scaling),
one new query token per sequence, synthetic random caches laid out exactly as serving/cache.py stores them:
nuq-4 / nuq-2 (KVQuant: pre-RoPE per-channel keys through a 16- / 4-level codebook, rotated in the kernel, values
per token, one fp16 sink row), nuq-4-1pct (the same plus 1% sparse outliers in K and V), fp8 (E4M3, post-RoPE,
per-tensor scale). The baseline is F.scaled_dot_product_attention on fp16 K/V with the GQA group folded into
the query length ([B, 8, 4, 128] queries against [B, 8, T, 128] keys), which reads each K/V row once.

Per (format, context, batch) row:
- step_ms: the kernel launch alone (triton.testing.do_bench median on a GPU; on the CPU the median wall time of
  interpreted calls, which says nothing about speed). Host metadata (outlier row offsets, split sizes) is
  prepared once per cache, as a serving runtime keeps it (DecodeLaunch);
- prepare_step_ms: serving.triton_attention.decode_attention, which prepares the launch on every call -- what
  a step costs when the runtime does not keep the launch;
- sdpa_ms, speedup = sdpa_ms / step_ms (> 1: the kernel is faster);
- bytes_read: every stored byte of K and V the step reads (codes, scales, zero points, outliers, sink rows) for
  all sequences; sdpa_bytes_read: the fp16 K and V (2 bytes per element); bytes_ratio = bytes_read /
  sdpa_bytes_read; gbps / sdpa_gbps: those bytes over the step time;
- max_rel_err: the kernel against the oracle (runtime_check/reference.py, on the CPU) at the first context and
  batch of each format (None elsewhere: the oracle of a 128k cache takes longer than the whole benchmark).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Callable

import torch

H_Q, H_KV, D = 32, 8, 128
FORMATS = ("nuq-4", "nuq-2", "nuq-4-1pct", "fp8")


def _rotary(device):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    cfg = LlamaConfig(hidden_size=H_Q * D, num_attention_heads=H_Q, num_key_value_heads=H_KV, head_dim=D,
                      max_position_embeddings=131072 + 16, rope_theta=500000.0,
                      rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    return LlamaRotaryEmbedding(cfg).to(device)


def _outliers(b: int, t: int, per_row: int, g: torch.Generator, device) -> dict:
    """per_row outliers in every token row (of H_KV * D entries), sorted within the row, as cache.store lays them."""
    idx = torch.sort(torch.randint(0, H_KV * D, (t * b, per_row), generator=g, device=device), dim=1).values
    return {"outlier_count": torch.full((t, b), per_row, dtype=torch.int16, device=device),
            "outlier_index": idx.reshape(-1).to(torch.int16),
            "outlier_value": torch.randn(t * b * per_row, generator=g, device=device).half() * 8}


def make_cache(fmt: str, b: int, t: int, device, g: torch.Generator):
    """-> DecodeInputs over a random stored cache of t tokens (all encoded but a sink row for nuq)."""
    from exporters.codec import TensorPolicy
    from exporters.layout import StoredBlock
    from serving.inputs import DecodeInputs

    shape = (b, H_KV, t, D)
    q = torch.randn(b, H_Q, D, generator=g, device=device)
    rotary = _rotary(device)
    if fmt == "fp8":
        pk = TensorPolicy(format="fp8", bits=8, axis="tensor", fp8_scale=torch.tensor(0.02, device=device))
        pv = TensorPolicy(format="fp8", bits=8, axis="tensor", fp8_scale=torch.tensor(0.01, device=device))

        def dense():
            return torch.randn(shape, generator=g, device=device).mul(64).to(torch.float8_e4m3fn)

        return DecodeInputs(q=q, scaling=D ** -0.5, key_policy=pk, value_policy=pv, key_rope="post", rotary=rotary,
                            k_block=StoredBlock(0, shape, {"dense": dense()}),
                            v_block=StoredBlock(0, shape, {"dense": dense()}))
    bits = int(fmt.split("-")[1])
    fraction = 0.01 if fmt.endswith("1pct") else 0.0
    book = torch.sort(torch.rand(2 ** bits, generator=g, device=device) * 2 - 1).values
    pk = TensorPolicy(format="nuq", bits=bits, axis="channel", outlier_fraction=fraction, codebook=book,
                      zero=torch.randn(H_KV, D, generator=g, device=device) * 0.1,
                      range=torch.rand(H_KV, D, generator=g, device=device) + 0.5,
                      lower=torch.full((H_KV, D), -1.0, device=device), upper=torch.full((H_KV, D), 1.0, device=device))
    pv = TensorPolicy(format="nuq", bits=bits, axis="token", outlier_fraction=fraction, codebook=book.clone())
    n = t - 1
    enc = (b, H_KV, n, D)

    def codes():
        return torch.randint(0, 256, (b, H_KV, n, D * bits // 8), generator=g, device=device, dtype=torch.uint8)

    k_t = {"codes": codes()}
    v_t = {"codes": codes(), "scale": torch.rand(b, H_KV, n, 1, generator=g, device=device).half() + 0.5,
           "zero": torch.randn(b, H_KV, n, 1, generator=g, device=device).half() * 0.1}
    if fraction:
        per_row = round(fraction * H_KV * D)
        k_t |= _outliers(b, n, per_row, g, device)
        v_t |= _outliers(b, n, per_row, g, device)
    sink = tuple(torch.randn(b, H_KV, 1, D, generator=g, device=device).half() for _ in range(2))
    return DecodeInputs(q=q, scaling=D ** -0.5, key_policy=pk, value_policy=pv, key_rope="pre", rotary=rotary,
                        sink=sink, k_block=StoredBlock(1, enc, k_t), v_block=StoredBlock(1, enc, v_t))


def stored_bytes(inp) -> int:
    held = [x for pair in (inp.sink, inp.recent) if pair is not None for x in pair]
    held += [x for blk in (inp.k_block, inp.v_block) if blk is not None for x in blk.tensors.values()]
    return sum(x.numel() * x.element_size() for x in held)


def max_rel_err(inp, block_t: int = 32) -> float:
    from runtime_check import reference
    from serving.inputs import inputs_to
    from serving.triton_attention import decode_attention

    out = decode_attention(inp, block_t=block_t).cpu()
    ref = reference.decode_attention(inputs_to(inp, "cpu"))
    return float((out - ref).abs().max() / ref.abs().max())


def _timer(device: torch.device, cpu_reps: int) -> Callable[[Callable], float]:
    """fn -> milliseconds per call: do_bench's median on a GPU, the median of cpu_reps wall-clock calls on the CPU."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return lambda fn: do_bench(fn, return_mode="median")

    def wall(fn) -> float:
        times = []
        for _ in range(cpu_reps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return 1000 * statistics.median(times)

    return wall


def measure(contexts: list[int], batches: list[int], formats: list[str], device: torch.device | str,
            deadline: float | None = None, on_row: Callable[[dict], None] | None = None, cpu_reps: int = 1,
            seed: int = 0) -> dict:
    """Every (context, batch, format) row (see the module docstring) -> {"rows", "skipped"}. deadline
    (time.monotonic()): (context, batch) pairs not started by then are listed in "skipped" instead of measured."""
    import torch.nn.functional as F

    from serving.triton_attention import decode_attention, prepare, run

    device = torch.device(device)
    unknown = sorted(set(formats) - set(FORMATS))
    if unknown:
        raise ValueError(f"bench.kernel: formats must be among {FORMATS}, got {unknown}")
    block_t = 32 if device.type == "cuda" else 256  # the interpreter's cost is per tile op: few large tiles
    bench = _timer(device, cpu_reps)
    g = torch.Generator(device=device).manual_seed(seed)
    rows, skipped = [], []
    for t in contexts:
        for b in batches:
            if deadline is not None and time.monotonic() > deadline:
                skipped.append({"context": t, "batch": b, "reason": "time budget spent"})
                continue
            q = torch.randn(b, H_KV, H_Q // H_KV, D, generator=g, device=device, dtype=torch.float16)
            k = torch.randn(b, H_KV, t, D, generator=g, device=device, dtype=torch.float16)
            v = torch.randn_like(k)
            sdpa_ms = bench(lambda: F.scaled_dot_product_attention(q, k, v))
            sdpa_bytes = k.numel() * k.element_size() + v.numel() * v.element_size()
            del q, k, v
            for fmt in formats:
                inp = make_cache(fmt, b, t, device, g)
                launch = prepare(inp, block_t=block_t)
                ms = bench(lambda: run(launch))
                prepare_ms = bench(lambda: decode_attention(inp, block_t=block_t))
                read = stored_bytes(inp)
                first = t == contexts[0] and b == batches[0]
                row = {"format": fmt, "context": t, "batch": b, "step_ms": ms, "prepare_step_ms": prepare_ms,
                       "sdpa_ms": sdpa_ms, "speedup": sdpa_ms / ms, "bytes_read": read, "sdpa_bytes_read": sdpa_bytes,
                       "bytes_ratio": read / sdpa_bytes, "bytes_per_token": read / (b * t),
                       "sdpa_bytes_per_token": sdpa_bytes / (b * t), "gbps": read / ms / 1e6,
                       "sdpa_gbps": sdpa_bytes / sdpa_ms / 1e6,
                       "max_rel_err": max_rel_err(inp, block_t) if first else None}
                rows.append(row)
                if on_row is not None:
                    on_row(row)
                del inp, launch
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    return {"rows": rows, "skipped": skipped, "block_t": block_t,
            "shape": {"n_q_heads": H_Q, "n_kv_heads": H_KV, "head_dim": D},
            "timer": "triton.testing.do_bench median" if device.type == "cuda"
            else f"median of {cpu_reps} wall-clock calls (Triton interpreted: not a speed)"}


def format_row(r: dict) -> str:
    err = "" if r["max_rel_err"] is None else f"{r['max_rel_err']:.2e}"
    return (f"{r['format']:<11} {r['context']:>7} {r['batch']:>5} {r['step_ms']:>9.4f} {r['prepare_step_ms']:>9.4f} "
            f"{r['sdpa_ms']:>9.4f} {r['speedup']:>7.2f} {r['bytes_ratio']:>6.3f} {r['gbps']:>7.1f} {err:>9}")


HEADER = (f"{'format':<11} {'context':>7} {'batch':>5} {'step_ms':>9} {'prep_ms':>9} {'sdpa_ms':>9} {'speedup':>7} "
          f"{'bytes':>6} {'GB/s':>7} {'rel_err':>9}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--contexts", default=None, help="default 4096,16384,65536,131072 (--cpu: 256)")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--cpu", action="store_true", help="dry run on the CPU: Triton interpreted, times meaningless")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.cpu:
        import os
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported (measure imports it)
    elif not torch.cuda.is_available():
        print("bench.kernel: skipped: no CUDA GPU (decode-kernel latency is measured natively only; --cpu: dry run)")
        return 0
    from bench.common import write_json

    device = torch.device("cpu" if args.cpu else "cuda")
    contexts = [int(x) for x in (args.contexts or ("256" if args.cpu else "4096,16384,65536,131072")).split(",")]
    batches = [int(x) for x in args.batches.split(",")]
    name = "cpu (TRITON_INTERPRET=1)" if args.cpu else torch.cuda.get_device_name()
    print(f"{name}: decode attention, {H_Q} q heads / {H_KV} kv heads / head_dim {D}")
    print(HEADER)
    res = measure(contexts, batches, args.formats.split(","), device, on_row=lambda r: print(format_row(r), flush=True))
    write_json(args.json, {"device": name, **res})
    return 0


if __name__ == "__main__":
    sys.exit(main())
