"""One RoPE round trip for a bfloat16 model (docs/manifest.md, RoPE: precision): the evaluation, the serving cache
(serving/cache.py, materialized and block-wise) and the oracle (runtime_check/reference.py) invert and
re-apply RoPE with the same float32 tables on float32 keys, so they serve the same keys -- to float32 rounding --
whatever the model's dtype. Before, a bfloat16 model saw three round trips: bf16 tables in the evaluation (and
bf16 decoded K/V), bf16 tables to invert and float32 ones to re-apply in the block-wise reader and the oracle."""
from types import SimpleNamespace

import pytest
import torch

from exporters.codec import CachePolicy, TensorPolicy
from pipeline.config import load_recipe
from runtime_check import reference
from serving.blockwise import serving, stored_blocks
from serving.cache import ArtifactCache, from_layer
from stages import evaluate, recipe
from stages.hooks import rope_tables

FP16 = TensorPolicy(format="fp16", bits=16)
INT4 = TensorPolicy(format="uniform", bits=4, axis="token")
FLOAT32_ROUNDING = 1e-6  # per-row relative: a few float32 ulps of the same rotation computed twice


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max over rows of ||a - b|| / ||b|| (rows: the last axis)."""
    a, b = a.float(), b.float()
    return float(((a - b).norm(dim=-1) / b.norm(dim=-1).clamp_min(1e-30)).max())


def _evaluated(monkeypatch, run) -> list[dict]:
    """Runs `run()` with the evaluation's attention observed: per call, the layer, the K/V it was given and the
    K/V it attends to (the served rows, what stages.evaluate.quantized_attention hands to its attention)."""
    calls: list[dict] = []
    real_attention, real_sdpa = evaluate.quantized_attention, evaluate.sdpa_attention

    def attention(*args, **kwargs):
        attn = real_attention(*args, **kwargs)

        def observed(module, query, key, value, mask, scaling):
            calls.append({"layer": module.layer_idx, "key": key, "value": value})
            return attn(module, query, key, value, mask, scaling)
        return observed

    def sdpa(query, key, value, mask, scaling):
        calls[-1].update(served_key=key, served_value=value)
        return real_sdpa(query, key, value, mask, scaling)

    monkeypatch.setattr(evaluate, "quantized_attention", attention)
    monkeypatch.setattr(evaluate, "sdpa_attention", sdpa)
    run()
    return calls


def _served_by_cache(layer, key, value) -> dict:
    """Feeds key, value [B, H, T, D] to a cache layer one token at a time -> its decoded keys: the oracle's, the
    block-wise reader's (float32) and the materialized ones (the model's dtype, for the model's own attention)."""
    for i in range(key.shape[2]):
        layer.update(key[:, :, i : i + 1], value[:, :, i : i + 1])
    inp = from_layer(layer, torch.zeros(key.shape[0], 1, key.shape[-1]), 1.0, layer.rotary)
    return {"oracle": reference.cached_kv(inp)[0],
            "blockwise": torch.cat([k for k, _, _ in stored_blocks(inp, key.shape[2])], 2),
            "materialized": layer.materialize()[0]}


@pytest.fixture(scope="module")
def llama3_bf16():
    """One layer of Llama-3.1-8B's attention shapes and RoPE (head_dim 128, theta 5e5, llama3 scaling) in bfloat16,
    the rest shrunk (pipeline.shapes, random weights)."""
    from pipeline.shapes import random_model, shape_config

    c = shape_config("llama3-8b", 1)
    c.hidden_size, c.intermediate_size, c.vocab_size = 256, 512, 1000
    c.num_attention_heads, c.num_key_value_heads = 4, 1
    model, _ = random_model(c, seed=0, dtype=torch.bfloat16)
    assert model.config.head_dim == 128 and model.model.rotary_emb.inv_freq.dtype == torch.float32
    return model.eval()


@pytest.mark.parametrize("key", [FP16, INT4], ids=["fp16-keys", "int4-keys"])
def test_evaluation_cache_and_oracle_serve_the_same_keys_at_8k_positions(llama3_bf16, monkeypatch, key):
    """Pre-RoPE keys of a bfloat16 model at positions 0..8191 (D = 128, theta 5e5): the evaluation's served keys,
    the cache's decoded keys (oracle, block-wise reader) agree to float32 rounding, and the materialized rows
    are those keys rounded once to bfloat16. fp16-stored keys come back within fp16's own rounding of the
    pre-RoPE key (2^-11 per element): the round trip adds nothing. The old round trips: 2.7e-3 (cache, bf16
    tables to invert, float32 to re-apply) and 3.7e-3 (evaluation, bf16 tables and bf16 keys) per row."""
    t, d = 8192, 128
    g = torch.Generator().manual_seed(0)
    k = (torch.randn(1, 1, t, d, generator=g) * 2).to(torch.bfloat16)  # post-RoPE keys as the model gives them
    v = torch.randn(1, 1, t, d, generator=g).to(torch.bfloat16)
    policy = CachePolicy(f"pre-{key.format}", [(key, INT4)], key_rope="pre", n_sink=1)
    rope = rope_tables(llama3_bf16, torch.zeros(1, t, dtype=torch.long))
    query = torch.zeros(1, 4, t, d, dtype=torch.bfloat16)
    with torch.no_grad():
        calls = _evaluated(monkeypatch, lambda: evaluate.quantized_attention(policy, rope, None)(
            SimpleNamespace(layer_idx=0), query, k, v, None, d ** -0.5))
        evaluated = calls[0]["served_key"]
        cache = ArtifactCache(policy, llama3_bf16)
        layer = cache.layers[0]
        layer.update(k, v)  # one chunk of 8192 rows (stored as one at a time would store them: no residual)
        inp = from_layer(layer, torch.zeros(1, 4, d), d ** -0.5, layer.rotary)
        oracle = reference.cached_kv(inp)[0]
        blockwise = torch.cat([kb for kb, _, _ in stored_blocks(inp, t)], 2)
    if key.format == "fp16":  # stored fp16 pre-RoPE: 2^-11 per element, about 3e-4 per row, and nothing more
        assert {"evaluated": _rel(evaluated, k), "cache": _rel(oracle, k)} == pytest.approx({"evaluated": 0, "cache": 0},
                                                                                           abs=1e-3)
    assert _rel(evaluated, oracle) <= FLOAT32_ROUNDING, _rel(evaluated, oracle)
    assert _rel(blockwise, oracle) <= FLOAT32_ROUNDING, _rel(blockwise, oracle)
    assert torch.equal(layer.materialize()[0], oracle.to(torch.bfloat16))
    assert evaluated.dtype == oracle.dtype == blockwise.dtype == torch.float32


@pytest.fixture(scope="module")
def tiny_bf16():
    from pipeline.config import ModelConfig
    from pipeline.model import load_model
    return load_model(ModelConfig(name="tiny", source="tiny", dtype="bfloat16"))


def _tiny_policy(tiny_bf16, calib, name: str) -> CachePolicy:
    if name == "fp16-keys":  # keys stored fp16 before RoPE: only the round trip can move them
        return CachePolicy(name, [(FP16, INT4)] * tiny_bf16.spec.n_layers, key_rope="pre", n_sink=1)
    return recipe.build_policy(load_recipe(name), tiny_bf16.spec.n_layers, calib["plain"])


@pytest.mark.parametrize("name", ["fp16-keys", "kvquant-4b-1pct"])
def test_the_bf16_evaluation_serves_what_the_cache_and_the_oracle_serve(tiny_bf16, tiny_windows, calib,
                                                                        monkeypatch, name):
    """The tiny Llama in bfloat16, pre-RoPE recipes, a 48-token window: in every layer the keys the evaluation
    attends to equal the keys the serving cache decodes from the same K/V fed one token at a time (the oracle's,
    the block-wise reader's) to float32 rounding, and the cache's materialized rows are them in bfloat16. The
    log-probabilities equal block-wise serving of the window (one chunk, its rows read as stored: the same
    bfloat16 arithmetic outside the attention; both attentions float32, their outputs rounded to bfloat16): any
    difference would be a bfloat16 step of a logit, >= 4e-3 (the old round trips: 8e-3 to 4.5e-2)."""
    policy = _tiny_policy(tiny_bf16, calib, name)
    model, ids = tiny_bf16.model, tiny_windows.eval[:1]
    with torch.no_grad():
        ours = []
        calls = _evaluated(monkeypatch, lambda: ours.append(evaluate.policy_logprobs(model, ids, policy)))
        assert [c["layer"] for c in calls] == list(range(tiny_bf16.spec.n_layers))
        cache = ArtifactCache(policy, model)
        for c in calls:
            served = _served_by_cache(cache.layers[c["layer"]], c["key"], c["value"])
            assert _rel(c["served_key"], served["oracle"]) <= FLOAT32_ROUNDING, (c["layer"], _rel(c["served_key"],
                                                                                                served["oracle"]))
            assert _rel(served["blockwise"], served["oracle"]) <= FLOAT32_ROUNDING
            assert torch.equal(served["materialized"], served["oracle"].to(torch.bfloat16))
            assert c["served_key"].dtype == torch.float32
        cache = ArtifactCache(policy, model, attention="blockwise", prefill="stored")
        with serving(model, cache, kernel=False):
            blockwise = torch.log_softmax(model(ids, cache=cache).logits[0].float(), -1)
    assert (ours[0] - blockwise).abs().max() <= 1e-3, float((ours[0] - blockwise).abs().max())
