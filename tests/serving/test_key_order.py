"""Where a flushed pre-RoPE key is encoded from, on a model whose outputs depend on its cache (the embedded
SmolLM2-135M, real activations; a tiny random model's KLs are ~1e-6 for every cache and cannot tell).

docs/manifest.md ("Appending, at step t", step 3, and RoPE "Precision"): the cache receives the post-RoPE key as the
model computes it, rounds it to fp16, and a flushed row is encoded from that fp16 copy taken to float32, rotated
back by -a at its own position with the float32 tables of the manifest's `rope` -- the reading an engine can serve
(vLLM hands its attention backend post-RoPE keys in the model's dtype). Here a consumer written from those
sentences alone (exporters.rope's tables from theta, exporters.codec) is held against what the evaluation encodes
(stages/evaluate.py) and what the serving cache stores and reads back (serving/cache.py, the fused CPU encoder where
built), on every layer; and the other reading -- the key before RoPE, unrounded or rounded to fp16 -- is shown to
store other codes, so the test can tell the two apart."""
import json

import pytest
import torch

import stages.evaluate as ev
from exporters.codec import CachePolicy, TensorPolicy, decode, encode
from exporters.rope import apply_rope, invert_rope, rope_cos_sin
from serving.cache import ArtifactCache
from stages.hooks import attention_layers, forward_hooks

T, SINK, RESIDUAL = 320, 16, 64


@pytest.fixture(scope="module")
def setup(smollm2):
    from pipeline.check import eval_ids

    model, spec = smollm2.model, smollm2.spec
    ids = eval_ids(smollm2.tokenizer, 1, T)
    pre = {}

    def grab(i):
        def hook(_m, _a, out):
            pre[i] = out.detach().view(1, T, spec.n_kv_heads, spec.head_dim).transpose(1, 2).float()
        return hook

    with torch.no_grad(), forward_hooks([(a.k_proj, grab(i), False) for i, a in enumerate(attention_layers(model))]):
        model(ids)
    book = torch.linspace(-1, 1, 16)
    layers = []
    for i in range(spec.n_layers):  # per-channel 4-bit keys with bounds from this window's own pre-RoPE keys
        k = pre[i][0].transpose(0, 1).reshape(T, -1)
        lo, hi = (torch.quantile(k, q, dim=0).view(spec.n_kv_heads, spec.head_dim) for q in (0.01, 0.99))
        layers.append((TensorPolicy(format="nuq", bits=4, axis="channel", outlier_fraction=0.01, codebook=book,
                                    zero=(hi + lo) / 2, range=(hi - lo) / 2, lower=lo, upper=hi),
                       TensorPolicy(format="uniform", bits=4, axis="token")))
    policy = CachePolicy("kvq-pre", layers, key_rope="pre", n_sink=SINK, residual=RESIDUAL)
    # the manifest's model.rope (exporters/manifest.py writes spec.rope_theta / rope_scaling), as a consumer reads it
    cos, sin = rope_cos_sin(torch.arange(T), spec.head_dim, spec.rope_theta, json.loads(spec.rope_scaling))
    return model, spec, ids, policy, pre, (cos, sin)


def spec_source(post: torch.Tensor, cos, sin, start: int) -> torch.Tensor:
    """docs/manifest.md's reading: the fp16 copy of the post-RoPE key, to float32, rotated back in float32."""
    n = post.shape[2]
    return invert_rope(post.to(torch.float16).float(), cos[start:start + n], sin[start:start + n])


def test_the_evaluation_encodes_the_fp16_post_rope_key_rotated_back(setup, monkeypatch):
    model, spec, ids, policy, pre, (cos, sin) = setup
    seen, sources = {}, {}
    real_attn = ev.quantized_attention(policy, ev.rope_tables(model, ids), None, None, None)

    def attn(module, query, key, value, mask, scaling):
        seen[module.layer_idx] = key.detach()
        return real_attn(module, query, key, value, mask, scaling)

    real_fake_quant = ev.fake_quant

    def fake_quant(x, p, what):
        if what.endswith("keys"):
            sources[int(what.split()[1])] = x.detach().clone()
        return real_fake_quant(x, p, what)

    monkeypatch.setattr(ev, "fake_quant", fake_quant)
    with torch.no_grad(), ev.attention_override(model, attn):
        model.model(ids, use_cache=False)
    flips = []
    for i in range(spec.n_layers):
        want = spec_source(seen[i][:, :, SINK:], cos, sin, SINK)
        assert torch.equal(sources[i], want), f"layer {i}: the evaluation encodes another key than the spec's"
        codes = encode(want, policy.layers[i][0]).codes
        flips.append(float((encode(pre[i][:, :, SINK:], policy.layers[i][0]).codes != codes).float().mean()))
    # the other reading stores other codes (layer 0's keys are the same forward's in both readings)
    assert flips[0] > 1e-4 and sum(flips) / len(flips) > 1e-4, flips


def test_the_serving_cache_stores_the_fp16_post_rope_key_rotated_back(setup):
    model, spec, ids, policy, pre, (cos, sin) = setup
    cache = ArtifactCache(policy, model)
    received = {}
    for i, layer in enumerate(cache.layers):
        update = layer.update

        def recording(k, v, *a, _i=i, _u=update, **kw):
            received[_i] = k.detach().clone()
            return _u(k, v, *a, **kw)

        layer.update = recording
    with torch.no_grad():
        model(ids, cache=cache, use_cache=True)
    n_enc = T - SINK - RESIDUAL  # one prefill: every row past the sinks but the last RESIDUAL is encoded
    worst_spec, worst_pre = 0.0, []
    for i, layer in enumerate(cache.layers):
        keys, _ = layer.materialize()
        got = keys[:, :, SINK:SINK + n_enc].float()
        pk = policy.layers[i][0]
        mine = apply_rope(decode(encode(spec_source(received[i][:, :, SINK:SINK + n_enc], cos, sin, SINK), pk), pk),
                          cos[SINK:SINK + n_enc], sin[SINK:SINK + n_enc])
        other = apply_rope(decode(encode(pre[i][:, :, SINK:SINK + n_enc].to(torch.float16).float(), pk), pk),
                           cos[SINK:SINK + n_enc], sin[SINK:SINK + n_enc])
        worst_spec = max(worst_spec, float((got - mine).abs().max()))
        worst_pre.append(float((got - other).abs().max()))
    # the consumer's keys equal the cache's to float32 rotation rounding; the pre-RoPE reading is a code step away
    assert worst_spec < 1e-4, worst_spec
    assert min(worst_pre[:1]) > 100 * max(worst_spec, 1e-6), (worst_spec, worst_pre)
