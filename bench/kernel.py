"""Decode-attention latency: the Triton kernels over the stored cache vs torch SDPA on fp16 K/V (GPU only).

python -m bench.kernel [--contexts 4096,16384,65536,131072] [--batches 1,8] [--json PATH]

One layer of the Llama-3-8B attention shape (32 query heads, 8 kv heads, head_dim 128, Llama-3 RoPE scaling),
one new query token per sequence, synthetic random caches laid out exactly as runtime_check/cache.py stores them:
nuq-4 / nuq-2 (KVQuant: pre-RoPE per-channel keys through a 16- / 4-level codebook, rotated in the kernel, values
per token, one fp16 sink row), nuq-4-1pct (the same plus 1% sparse outliers in K and V), fp8 (E4M3, post-RoPE,
per-tensor scale). The baseline is F.scaled_dot_product_attention on fp16 K/V with the GQA group folded into
the query length ([B, 8, 4, 128] queries against [B, 8, T, 128] keys), which reads each K/V row once.
Times are triton.testing.do_bench medians of the launch alone: host metadata (outlier row offsets, split sizes)
is prepared once per cache, as a serving runtime keeps it. bytes/token counts every stored byte of K and V.
The first context of every format is also checked against the oracle (max_rel_err).
"""
from __future__ import annotations

import argparse
import sys

import torch

H_Q, H_KV, D = 32, 8, 128


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
    from runtime_check.inputs import DecodeInputs

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


def max_rel_err(inp) -> float:
    from runtime_check import reference
    from runtime_check.inputs import inputs_to
    from runtime_check.triton_attention import decode_attention

    out = decode_attention(inp).cpu()
    ref = reference.decode_attention(inputs_to(inp, "cpu"))
    return float((out - ref).abs().max() / ref.abs().max())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--contexts", default="4096,16384,65536,131072")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--formats", default="nuq-4,nuq-2,nuq-4-1pct,fp8")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.kernel: skipped: no CUDA GPU (decode-kernel latency is measured natively only)")
        return 0
    import torch.nn.functional as F
    from triton.testing import do_bench

    from bench.common import write_json
    from runtime_check.triton_attention import prepare, run

    device = torch.device("cuda")
    contexts = [int(x) for x in args.contexts.split(",")]
    batches = [int(x) for x in args.batches.split(",")]
    formats = args.formats.split(",")
    g = torch.Generator(device=device).manual_seed(0)
    rows, sdpa = [], {}
    print(f"{torch.cuda.get_device_name()}: decode attention, {H_Q} q heads / {H_KV} kv heads / head_dim {D}")
    print(f"{'format':<11} {'context':>7} {'batch':>5} {'ms':>8} {'sdpa_ms':>8} {'speedup':>7} {'B/token':>8} "
          f"{'GB/s':>7} {'rel_err':>9}")
    for t in contexts:
        for b in batches:
            q = torch.randn(b, H_KV, H_Q // H_KV, D, generator=g, device=device, dtype=torch.float16)
            k = torch.randn(b, H_KV, t, D, generator=g, device=device, dtype=torch.float16)
            v = torch.randn_like(k)
            sdpa[t, b] = do_bench(lambda: F.scaled_dot_product_attention(q, k, v), return_mode="median")
            del q, k, v
            for fmt in formats:
                inp = make_cache(fmt, b, t, device, g)
                launch = prepare(inp)
                ms = do_bench(lambda: run(launch), return_mode="median")
                per_token = stored_bytes(inp) / (b * t)
                err = max_rel_err(inp) if (t, b) == (contexts[0], batches[0]) else None
                row = {"format": fmt, "context": t, "batch": b, "ms": round(ms, 4), "sdpa_ms": round(sdpa[t, b], 4),
                       "speedup": round(sdpa[t, b] / ms, 3), "bytes_per_token": round(per_token, 1),
                       "sdpa_bytes_per_token": 2 * H_KV * D * 2, "gbps": round(per_token * b * t / ms / 1e6, 1),
                       "max_rel_err": err}
                rows.append(row)
                print(f"{fmt:<11} {t:>7} {b:>5} {ms:>8.4f} {row['sdpa_ms']:>8.4f} {row['speedup']:>7.2f} "
                      f"{per_token:>8.1f} {row['gbps']:>7.1f} {'' if err is None else f'{err:.2e}':>9}")
                del inp, launch
                torch.cuda.empty_cache()
    write_json(args.json, {"device": torch.cuda.get_device_name(), "shape": {"n_q_heads": H_Q, "n_kv_heads": H_KV,
                                                                           "head_dim": D}, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
