"""A second architecture, Gemma 3, on a tiny random model (tests/conftest.py tiny_gemma3): pre-RoPE keys are the
keys just before RoPE -- the k_norm output, not k_proj's -- in every stage that hooks them, and every layer is
rotated with its own table (local layers and global layers have different RoPE bases)."""
import copy

import pytest
import torch

from exporters.rope import LayerRotary, invert_rope
from stages import fisher, prefix_tokens, smooth_attention, traces
from stages.base import InputError
from stages.calibration_rows import rotate_rows
from stages.hooks import (attention_layers, attention_override, forward_hooks, head_rows, key_module, layer_rope,
                          model_rotaries, query_module, rope_tables, sdpa_attention)


def _ids(lm, n=40, seed=0):
    return torch.randint(3, 1000, (1, n), generator=torch.Generator().manual_seed(seed))


def _capture(lm, ids):
    """k_proj / k_norm / q_norm outputs as [H, T, D] and the post-RoPE keys the attention receives, per layer."""
    spec, out = lm.spec, {}

    def grab(name, i, n_heads):
        def hook(_m, _inp, o):
            out[name, i] = head_rows(o, n_heads, spec.head_dim)[0].transpose(0, 1).detach()
        return hook

    hooks = []
    for i, a in enumerate(attention_layers(lm.model)):
        hooks += [(a.k_proj, grab("k_proj", i, spec.n_kv_heads), False),
                  (a.k_norm, grab("k_norm", i, spec.n_kv_heads), False),
                  (a.q_norm, grab("q_norm", i, spec.n_q_heads), False)]

    def keep(module, query, key, value, mask, scaling):
        out["post", module.layer_idx] = key[0].detach()
        return sdpa_attention(query, key, value, mask, scaling)

    with torch.no_grad(), forward_hooks(hooks), attention_override(lm.model, keep):
        lm.model.model(ids, use_cache=False)
    return out


def test_the_hook_points_are_the_norms(tiny_gemma3):
    attn = attention_layers(tiny_gemma3.model)[0]
    assert key_module(attn) is attn.k_norm and query_module(attn) is attn.q_norm


def test_layers_rotate_with_their_own_table(tiny_gemma3):
    lm = tiny_gemma3
    rotaries = model_rotaries(lm.model)
    assert [r.layer_type for r in rotaries] == lm.model.config.layer_types
    assert all(isinstance(r, LayerRotary) for r in rotaries) and rotaries[0] is rotaries[2]
    ids = _ids(lm)
    rope = rope_tables(lm.model, ids)
    assert "cos" not in rope  # two tables: a layer's must be asked for by layer
    cap = _capture(lm, ids)
    for layer in range(lm.spec.n_layers):
        cos, sin = layer_rope(rope, layer)
        pre = invert_rope(cap["post", layer][None], cos, sin)[0]
        # the keys just before RoPE are the k_norm output (not k_proj's: the norm changes them)
        assert torch.allclose(pre, cap["k_norm", layer], atol=1e-5)
        assert not torch.allclose(pre, cap["k_proj", layer], atol=1e-2)
        other = layer_rope(rope, layer ^ 1)  # the other layer type's table does not invert it
        assert not torch.allclose(invert_rope(cap["post", layer][None], *other)[0], cap["k_norm", layer], atol=1e-3)


def test_traces_and_fisher_take_the_normalized_keys(tiny_gemma3):
    lm = tiny_gemma3
    ids = _ids(lm, 48)
    res = traces.fit(traces.Inputs(lm.model, lm.spec, ids), traces.TracesConfig(reservoir_size=20))
    cap = _capture(lm, ids)
    t = res.tensors
    pos = t["res_pos"]
    for layer in range(lm.spec.n_layers):
        assert torch.allclose(t["res_k"][:, layer], cap["k_norm", layer].transpose(0, 1)[pos], atol=1e-6)
        k_norm = cap["k_norm", layer]
        assert torch.allclose(t["k_pre_absmax"][layer], k_norm.abs().amax(1), atol=1e-6)
        assert torch.allclose(t["q_absmax"][layer], cap["q_norm", layer].abs().amax(1), atol=1e-6)
        post = cap["post", layer]
        assert torch.allclose(t["k_post_absmax"][layer], post.abs().amax(1), atol=1e-6)
    # the reservoir's pre-RoPE rows rotated with each layer's own table are the keys the attention saw
    rotated = rotate_rows(t["res_k"], pos, model_rotaries(lm.model), torch.float32)
    for layer in range(lm.spec.n_layers):
        assert torch.allclose(rotated[:, layer], cap["post", layer].transpose(0, 1)[pos], atol=1e-5)
    f = fisher.fit(fisher.Inputs(lm.model, lm.spec, ids, t["res_sample"], t["res_pos"]))
    assert f.tensors["fisher_k"].shape == (pos.numel(), lm.spec.n_layers, lm.spec.n_kv_heads, lm.spec.head_dim)
    assert (f.tensors["fisher_k"] > 0).any() and torch.isfinite(f.tensors["fisher_k"]).all()


def test_fisher_is_the_gradient_at_the_key_norm(tiny_gemma3):
    """dL/dk at the k_norm output (autograd through a plain forward) for one reservoir row."""
    lm = tiny_gemma3
    ids = _ids(lm, 24, seed=3)
    res_sample, res_pos = torch.tensor([0, 0]), torch.tensor([5, 17])
    f = fisher.fit(fisher.Inputs(lm.model, lm.spec, ids, res_sample, res_pos))
    layer = 1
    norm = attention_layers(lm.model)[layer].k_norm
    kept = {}

    def hook(_m, _inp, out):  # the weights are frozen: a zero leaf added to the output takes its gradient
        kept["zero"] = torch.zeros_like(out, requires_grad=True)
        return out + kept["zero"]

    with torch.enable_grad(), forward_hooks([(norm, hook, False)]):
        out = lm.model(ids, labels=ids, use_cache=False)
        (grad,) = torch.autograd.grad(out.loss * (ids.shape[1] - 1), [kept["zero"]])
    g = head_rows(grad, lm.spec.n_kv_heads, lm.spec.head_dim)[0]   # [T, H, D]
    assert torch.allclose(f.tensors["fisher_k"][:, layer], g[res_pos].square(), rtol=1e-3, atol=1e-9)


def test_prefix_kv_pre_rope_keys_are_the_norm_output(tiny_gemma3):
    lm = tiny_gemma3
    ids = torch.tensor([5, 9, 1])
    kv = prefix_tokens.prefix_kv(lm.model, lm.spec, ids)
    cap = _capture(lm, ids[None])
    for layer in range(lm.spec.n_layers):
        assert torch.allclose(kv["k_pre"][layer], cap["k_norm", layer], atol=1e-6)
        assert torch.allclose(kv["k_post"][layer], cap["post", layer], atol=1e-6)


def test_smoothing_folds_into_the_norm_gains(tiny_gemma3):
    """With a key norm after k_proj, lambda goes into the norms' gains (x_normed * (1 + w)): the logits are
    unchanged and the keys just before RoPE become K / lambda."""
    lm = tiny_gemma3
    ids = _ids(lm, 20)
    n_layers, h, d = lm.spec.n_layers, lm.spec.n_kv_heads, lm.spec.head_dim
    lam = torch.rand(n_layers, h, d // 2, generator=torch.Generator().manual_seed(2)).add(0.5).repeat(1, 1, 2)
    folded = copy.deepcopy(lm.model)
    smooth_attention.fold(folded, lam, lm.spec.n_q_heads)
    with torch.no_grad():
        ref, got = lm.model(ids).logits, folded(ids).logits
    assert torch.allclose(ref, got, atol=1e-4, rtol=1e-4)
    before = _capture(lm, ids)
    after = _capture(type(lm)(model=folded, tokenizer=lm.tokenizer, spec=lm.spec), ids)
    for layer in range(n_layers):
        assert torch.allclose(after["k_norm", layer], before["k_norm", layer] / lam[layer][:, None], atol=1e-5)


def test_a_per_head_lambda_cannot_fold_into_a_shared_norm_gain():
    from pipeline.config import ModelConfig, TinyModelConfig
    from pipeline.model import load_model

    lm = load_model(ModelConfig(name="g", source="tiny", tiny=TinyModelConfig(
        arch="gemma3", n_layers=2, hidden_size=64, n_q_heads=4, n_kv_heads=2, head_dim=16, sliding_window=8)))
    lam = torch.ones(2, 2, 16)
    lam[0, 1] = 2.0
    with pytest.raises(InputError, match=r"layer 0's lambda differs between its 2 KV heads.*shared by every head"):
        smooth_attention.fold(copy.deepcopy(lm.model), lam, 4)


def test_the_evaluation_quantizes_each_layers_keys_before_its_own_rope(tiny_gemma3, monkeypatch):
    """A pre-RoPE recipe's evaluation inverts each layer's RoPE with that layer's table: what reaches the codec is
    the k_norm output (as the cache would receive it, in fp16) -- the space the codebooks were fitted in."""
    from exporters.codec import CachePolicy, TensorPolicy
    from stages import evaluate

    lm = tiny_gemma3
    ids = _ids(lm, 30)
    p = TensorPolicy(format="uniform", bits=8, axis="token")
    policy = CachePolicy("u8-pre", [(p, p)] * lm.spec.n_layers, key_rope="pre")
    seen = {}
    real = evaluate.fake_quant

    def spy(x, pol, where):
        if where.endswith(" keys"):
            seen[int(where.split()[1])] = x.detach().clone()
        return real(x, pol, where)

    monkeypatch.setattr(evaluate, "fake_quant", spy)
    k_norm = {}  # the k_norm outputs of this same forward (each layer reads the quantized layers before it)

    def grab(i):
        def hook(_m, _inp, out):
            k_norm[i] = head_rows(out, lm.spec.n_kv_heads, lm.spec.head_dim)[0].transpose(0, 1).detach()
        return hook

    hooks = [(a.k_norm, grab(i), False) for i, a in enumerate(attention_layers(lm.model))]
    with torch.no_grad(), forward_hooks(hooks):
        evaluate.policy_logprobs(lm.model, ids, policy)
    for layer in range(lm.spec.n_layers):
        # the keys reach the cache post-RoPE in fp16: inverted in float32, they are k_norm up to that rounding
        err = (seen[layer][0] - k_norm[layer]).abs().max()
        assert err < 4e-3 * k_norm[layer].abs().max(), (layer, float(err))


def test_the_residual_chunks_keep_the_sliding_window(tiny_gemma3, monkeypatch):
    """Long windows run the residual path in chunks of queries (stages.evaluate._residual_fused). On Gemma 3's
    local layers (sliding window 16 here, 48 tokens) each chunk must read only the rows the model's own mask lets
    its queries see: an fp16 cache with sinks and a recent window served through the chunks is the plain model,
    and quantized rows give the same log-probabilities in chunks as in one materialized pass."""
    from exporters.codec import CachePolicy, TensorPolicy
    from stages import evaluate

    lm = tiny_gemma3
    assert lm.model.config.sliding_window == 16
    ids = _ids(lm, n=48, seed=3)
    n = lm.spec.n_layers
    fp16, int2 = TensorPolicy(format="fp16", bits=16), TensorPolicy(format="uniform", bits=2, axis="token")
    exact = CachePolicy(name="fp16-windows", layers=[(fp16, fp16)] * n, n_sink=2, residual=8)
    coarse = CachePolicy(name="int2-windows", layers=[(int2, int2)] * n, n_sink=2, residual=8)
    with torch.no_grad():
        ref = torch.log_softmax(lm.model(ids).logits[0].float(), -1)
    whole = evaluate.policy_logprobs(lm.model, ids, coarse)
    monkeypatch.setattr(evaluate, "QUERY_CHUNK", 7)  # 7 chunks: the fused path, most chunks past the window
    assert (evaluate.policy_logprobs(lm.model, ids, exact) - ref).abs().max() < 1e-3
    chunked = evaluate.policy_logprobs(lm.model, ids, coarse)
    # summation order only (SDPA per chunk vs one softmax; Gemma's norms amplify it to ~2e-4 on this random model)
    assert torch.allclose(whole, chunked, atol=1e-3, rtol=0)
    assert (whole - ref).abs().max() > 1e-2  # the encoded rows are read: the comparison can tell a wrong chunk


def test_long_forwards_band_the_sliding_layers(tiny_gemma3, monkeypatch):
    """Past QUERY_CHUNK positions the reference and a recipe without a residual window run in chunks of queries,
    a sliding layer's chunk over its window's rows only (chunked_attention): on Gemma 3 (window 16, 48 tokens,
    chunks of 7) the model's own hidden states, and the recipe's log-probabilities of one pass. Passkey probes take
    the same paths."""
    from exporters.codec import CachePolicy, TensorPolicy
    from stages import evaluate, probes

    lm = tiny_gemma3
    ids = _ids(lm, n=48, seed=5)
    int2 = TensorPolicy(format="uniform", bits=2, axis="token")
    coarse = CachePolicy(name="int2", layers=[(int2, int2)] * lm.spec.n_layers, n_sink=2)
    with torch.no_grad():
        own = lm.model.model(ids, use_cache=False).last_hidden_state[0]
    whole = evaluate.policy_logprobs(lm.model, ids, coarse)
    prompt = {"ids": ids, "answer_from": 40, "length": 48, "depth": 0.5}
    cells = probes.fit(probes.Inputs(lm.model, lm.spec, [prompt], [coarse]), probes.ProbeConfig()).meta["cells"]
    monkeypatch.setattr(evaluate, "QUERY_CHUNK", 7)
    with torch.no_grad():
        banded = evaluate.full_precision_hidden(lm.model, ids)
    assert torch.allclose(banded, own, atol=1e-4 * own.abs().max(), rtol=0)
    assert torch.allclose(evaluate.policy_logprobs(lm.model, ids, coarse), whole, atol=1e-3, rtol=0)
    assert probes.fit(probes.Inputs(lm.model, lm.spec, [prompt], [coarse]), probes.ProbeConfig()).meta["cells"] == cells

