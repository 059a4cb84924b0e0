"""Run inside vLLM's environment by tests/serving/test_vllm_plugin.py (`.venv-vllm/bin/python
tests/serving/vllm_probe.py CHECKPOINT OUT`, the repository on PYTHONPATH): the plugin's write and both of its attention paths on one layer's
slots, against the codec as the oracle, with no engine around them.

Rows of known K (post-RoPE, as vLLM hands them over) and V at scattered positions of three blocks are written by
KvcalibCPUImpl._write into a page buffer laid out as vLLM lays out the packed spec (slots, then the sink rows);
then:
- every slot read back (exporters/vllm_slots.py unpack_side) equals the codec's encoding of the same rows
  (exporters.codec.encode of the pre-RoPE keys, rotated back with the manifest's RoPE) value for value after decode,
  and the sink rows equal the rows in fp16;
- the fused kernel's attention of one new token (_decode_one) and the decoded-rows path (_attend_rows) both equal the
  reference attention over the codec's rows (sink rows in fp16, RoPE re-applied), for a sequence of 1, n_sink and
  several hundred rows.
Writes {"checks": [{name, max_abs, scale}]} to OUT."""
from __future__ import annotations

import json
import sys

import torch


def main(folder: str, out: str) -> None:
    import serving.vllm_backend as vb
    from exporters import vllm_slots
    from exporters.codec import decode, encode
    from exporters.compressed_tensors import verify_checkpoint
    from exporters.rope import apply_rope, invert_rope, rope_cos_sin

    art = verify_checkpoint(folder)
    pol, m = art.policy, art.manifest["model"]
    h, d, hq = m["n_kv_heads"], m["head_dim"], m["n_q_heads"]
    served = vb.served_of(folder, art, 2048)
    if pol.residual:
        return window_main(served, out)
    cos, sin = served.cos, served.sin
    impl = vb.KvcalibCPUImpl.__new__(vb.KvcalibCPUImpl)
    layer_i = len(pol.layers) - 1
    impl.held_state(served, d ** -0.5, vb.layer_of(served, layer_i))
    lay = impl._layer.slot
    bs, nb = 32, 12
    page = lay.page_bytes(bs)
    raw = torch.zeros(nb * page + 64, dtype=torch.uint8)
    kv = torch.as_strided(raw, (nb, 1, bs, lay.slot_bytes), (page, bs * lay.slot_bytes, lay.slot_bytes, 1), 64)
    g = torch.Generator().manual_seed(0)
    t = 70
    pk, pv = pol.layers[layer_i]
    # pre-RoPE keys inside the calibrated channel bounds, and two entries beyond them on every other token (tokens
    # of 0 and 2 outliers in a page's pool, within its capacity: the overflow is tests/exporters/test_vllm_slots.py's),
    # rotated to post-RoPE as vLLM hands them over
    k_pre = pk.zero.float() + pk.range.float() * (torch.rand(t, h, d, generator=g) * 1.8 - 0.9)
    for i in range(0, t, 2):
        for j in torch.randperm(h * d, generator=g)[:2].tolist():
            hi, di = divmod(j, d)
            k_pre[i, hi, di] = pk.upper[hi, di].float() + pk.range[hi, di].float() * (0.5 + float(torch.rand(1, generator=g)))
    k_post = apply_rope(k_pre.permute(1, 0, 2)[None], cos[:t], sin[:t])[0].permute(1, 0, 2).contiguous()
    v = torch.randn(t, h, d, generator=g)
    v[:, 0, 3] *= 8                                          # a heavy value channel: per-token outliers
    blocks = torch.tensor([7, 2, 9])                         # scattered, as vLLM hands blocks out
    pos = torch.arange(t)
    slots = blocks[pos // bs] * bs + pos % bs
    # written in two steps (a prefill chunk, then the rest one by one), as vLLM writes them
    for a, b in [(0, 40)] + [(i, i + 1) for i in range(40, t)]:
        md = vb.PackedMetadata(b - a, [0, b - a], [b], blocks[None], slots[a:b], pos[a:b])
        impl._write(impl._layer, k_post[a:b], v[a:b], md, kv)
    checks = []
    s0 = lay.n_sink
    # the oracle: the codec's rows, encoded from the fp16 copies of what vLLM hands over (docs/manifest.md,
    # appending: the fp16 post-RoPE key, to float32, rotated back; the fp16 value)
    k_pre = invert_rope(k_post[s0:].half().float().permute(1, 0, 2)[None], cos[s0:t], sin[s0:t])
    k_ref = apply_rope(decode(encode(k_pre, pk), pk), cos[s0:t], sin[s0:t])           # [1, H, t - s0, D]
    v_ref = decode(encode(v[s0:].half().float().permute(1, 0, 2)[None], pv), pv)
    sink_k = k_post[:s0].to(torch.float16).float().permute(1, 0, 2)[None]
    sink_v = v[:s0].to(torch.float16).float().permute(1, 0, 2)[None]
    k_all, v_all = torch.cat([sink_k, k_ref], 2), torch.cat([sink_v, v_ref], 2)
    stored = kv[blocks, 0].reshape(-1, lay.slot_bytes)[s0:t]
    pooled = {}   # the key outliers from the pages' pools (exporters/vllm_slots.py)
    for name, where in lay.pools(bs).items():
        count, first, index, value = impl._pool_views(kv, where)
        pooled[name] = vllm_slots.pool_entries(count[blocks].reshape(-1)[s0:t], first[blocks].reshape(-1)[s0:t],
                                               (torch.arange(len(blocks) * bs) // bs)[s0:t], index[blocks],
                                               value[blocks])
    k_got = apply_rope(decode(vllm_slots.unpack_side(stored, lay.key, pk, h, d, pooled.get("key")), pk), cos[s0:t],
                       sin[s0:t])
    v_got = decode(vllm_slots.unpack_side(stored, lay.value, pv, h, d, pooled.get("value")), pv)
    checks.append({"name": "slots decode as the codec's keys", "max_abs": float((k_got - k_ref).abs().max()),
                   "scale": float(k_ref.abs().max())})
    checks.append({"name": "slots decode as the codec's values", "max_abs": float((v_got - v_ref).abs().max()),
                   "scale": float(v_ref.abs().max())})
    sink = impl._sink_view(kv, lay)[blocks[0], :s0].float()
    checks.append({"name": "sink rows", "max_abs": float((sink[:, 0] - k_post[:s0].half().float()).abs().max()
                                                         + (sink[:, 1] - v[:s0].half().float()).abs().max()),
                   "scale": 1.0})
    for n in sorted({1, max(1, s0), 33, t}):
        q = torch.randn(1, hq, d, generator=g)
        kk, vv = k_all[:, :, :n], v_all[:, :, :n]
        ref = torch.nn.functional.scaled_dot_product_attention(q[:, :, None].double(), kk.double(), vv.double(),
                                                               scale=d ** -0.5, enable_gqa=True)[:, :, 0].float()
        got_kernel = impl._decode_one(impl._layer, q, blocks, n, kv)
        got_rows = impl._attend_rows(impl._layer, q, blocks, n, kv)
        for name, got in (("kernel", got_kernel), ("rows", got_rows)):
            checks.append({"name": f"{name} attention over {n} rows", "max_abs": float((got - ref[0]).abs().max()),
                           "scale": float(ref.abs().max())})
    # a prefill chunk of 20 queries at the end: the rows path, causal within the chunk
    q = torch.randn(20, hq, d, generator=g)
    got = impl._attend_rows(impl._layer, q, blocks, t, kv)
    worst = 0.0
    for j in range(20):
        n = t - 20 + j + 1
        ref = torch.nn.functional.scaled_dot_product_attention(q[j][None, :, None].double(), k_all[:, :, :n].double(),
                                                               v_all[:, :, :n].double(), scale=d ** -0.5,
                                                               enable_gqa=True)[0, :, 0].float()
        worst = max(worst, float((got[j] - ref).abs().max()))
    checks.append({"name": "rows attention of a causal chunk", "max_abs": worst, "scale": 1.0})
    with open(out, "w") as f:
        json.dump({"checks": checks, "overflow": vb.STATS["overflow"], "slot_bytes": lay.slot_bytes}, f)


def window_main(served, out: str) -> None:
    """A recipe with a recent window (and per-layer slots, rotated values): every layer's rows written by the
    plugin's forward in the steps vLLM takes -- prefill chunks of several sizes, single decode steps between them
    -- and each query's output against the evaluation's reading (docs/manifest.md, "Reading"): at position p the
    sink rows and the rows [e(p + 1), p + 1) in fp16, the rows [n_sink, e(p + 1)) as the codec decodes them."""
    import serving.vllm_backend as vb
    from exporters.codec import decode, encode
    from exporters.rope import apply_rope, invert_rope

    pol, m = served.policy, served.manifest["model"]
    h, d, hq = m["n_kv_heads"], m["head_dim"], m["n_q_heads"]
    cos, sin = served.cos, served.sin
    S, R = pol.n_sink, pol.residual
    bs, nb, t = 32, 12, 230
    blocks = torch.tensor([7, 2, 9, 0, 11, 4, 5, 1])                  # scattered, as vLLM hands blocks out
    pos = torch.arange(t)
    slots = blocks[pos // bs] * bs + pos % bs
    cuts = [0, 7, 8, 9, 12, 50, 90] + list(range(91, 101)) + [170] + list(range(171, t + 1))   # chunks in and past the
    # sinks, decode steps, a chunk after them
    checks = []

    class Layer:
        layer_name = ""

    for li in range(len(pol.layers)):
        served.window = vb.Window(R, S, 4)
        g = torch.Generator().manual_seed(li)
        impl = vb.KvcalibCPUImpl.__new__(vb.KvcalibCPUImpl)
        impl.held_state(served, d ** -0.5, vb.layer_of(served, li), torch.zeros(4, S + R, 2, h, d,
                                                                                dtype=torch.float16))
        impl.kv_sharing_target_layer_name = None
        lay = impl._layer.slot    # this layer's page: its slots, its key outliers' pool
        page = lay.page_bytes(bs)
        raw = torch.zeros(nb * page + 64, dtype=torch.uint8)
        kv = torch.as_strided(raw, (nb, 1, bs, lay.slot_bytes), (page, bs * lay.slot_bytes, lay.slot_bytes, 1), 64)
        pk, pv = pol.layers[li]
        k_pre = torch.randn(t, h, d, generator=g)
        if pk.axis == "channel":   # inside the calibrated channel ranges, and some beyond the bounds: the pool's
            k_pre = pk.zero.float() + pk.range.float() * (torch.rand(t, h, d, generator=g) * 1.8 - 0.9)
            if pk.outlier_fraction > 0:
                for i in range(0, t, 3):
                    j = int(torch.randint(h * d, (1,), generator=g))
                    k_pre[i].view(-1)[j] = float(pk.upper.reshape(-1)[j]) + 1.0 + i / t
        k_post = apply_rope(k_pre.permute(1, 0, 2)[None], cos[:t], sin[:t])[0].permute(1, 0, 2).contiguous()
        v = torch.randn(t, h, d, generator=g)
        # the oracle's rows: sink and recent rows in fp16, the rest the codec's rows of the fp16 copies
        k16, v16 = k_post.half().float(), v.half().float()
        k_fp, v_fp = k16.permute(1, 0, 2)[None], v16.permute(1, 0, 2)[None]             # [1, H, t, D]
        k_enc = apply_rope(decode(encode(invert_rope(k_fp, cos[:t], sin[:t]) if pol.key_rope == "pre" else k_fp,
                                         pk), pk), cos[:t], sin[:t]) if pol.key_rope == "pre" else decode(
            encode(k_fp, pk), pk)
        v_enc = decode(encode(v_fp, pv), pv)
        worst = {"chunk": 0.0, "decode": 0.0}
        contrast = 0.0   # the same queries over the rows all decoded past the sinks: what a cache without the window reads
        for a, b in zip(cuts[:-1], cuts[1:]):
            md = vb.PackedMetadata(b - a, [0, b - a], [b], blocks[None], slots[a:b], pos[a:b])
            md.window = served.window.plan([int(blocks[0])], [a], [b], [b - a])
            q = torch.randn(b - a, hq, d, generator=g)
            output = torch.zeros(b - a, hq, d)
            impl.forward(Layer(), q, k_post[a:b], v[a:b], kv, md, output)
            for j, p in enumerate(range(a, b)):
                e = max(min(S, p + 1), p + 1 - R)
                use_fp = (torch.arange(p + 1) < min(S, p + 1)) | (torch.arange(p + 1) >= e)
                kk = torch.where(use_fp[None, None, :, None], k_fp[:, :, :p + 1], k_enc[:, :, :p + 1])
                vv = torch.where(use_fp[None, None, :, None], v_fp[:, :, :p + 1], v_enc[:, :, :p + 1])
                ref = torch.nn.functional.scaled_dot_product_attention(
                    q[j][None, :, None].double(), kk.double(), vv.double(), scale=d ** -0.5,
                    enable_gqa=True)[0, :, 0].float()
                plain = (torch.arange(p + 1) < min(S, p + 1))[None, None, :, None]
                other = torch.nn.functional.scaled_dot_product_attention(
                    q[j][None, :, None].double(), torch.where(plain, k_fp[:, :, :p + 1], k_enc[:, :, :p + 1]).double(),
                    torch.where(plain, v_fp[:, :, :p + 1], v_enc[:, :, :p + 1]).double(), scale=d ** -0.5,
                    enable_gqa=True)[0, :, 0].float()
                contrast = max(contrast, float((other - ref).abs().max()))
                kind = "decode" if b - a == 1 else "chunk"
                worst[kind] = max(worst[kind], float((output[j] - ref).abs().max()))
        for kind, w in worst.items():
            checks.append({"name": f"layer {li} ({pk.bits}/{pv.bits} bits, value rotation {pv.rotation}): {kind} "
                                   f"queries read the window as the evaluation", "max_abs": w, "scale": 1.0,
                           "contrast": contrast})
    with open(out, "w") as f:
        json.dump({"checks": checks, "overflow": vb.STATS["overflow"], "slot_bytes": served.slot(0).slot_bytes,
                   "window_misses": vb.STATS["window_misses"]}, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
