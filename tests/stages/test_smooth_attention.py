import copy

import pytest
import torch

from exporters.rope import apply_rope
from stages.smooth_attention import SmoothConfig
from stages.traces import TracesConfig
from stages import smooth_attention, traces
from stages.hooks import rope_tables
from stages.hooks import attention_layers, attention_override, forward_hooks, sdpa_attention


def _fit(q, k, alpha=0.5, beta=0.0):
    res = smooth_attention.fit(smooth_attention.Inputs(torch.tensor(q), torch.tensor(k), "rotate_half"), SmoothConfig(alpha, beta))
    return res.tensors["smooth"]


def test_rope_pairs_share_the_pair_maximum():
    # D = 4: channel 0 pairs with 2, channel 1 with 3. sqrt(max(4, 9)) = 3, sqrt(max(1, 0)) = 1
    lam = _fit([[[1.0, 1.0, 1.0, 1.0]]], [[[4.0, 1.0, 9.0, 0.0]]])
    assert lam.flatten().tolist() == [3.0, 1.0, 3.0, 1.0]


def test_beta_divides_by_the_query_pair_max_over_the_gqa_group():
    # H_q = 2 query heads read the one KV head: Q max over the group [3, 2, 1, 1] -> pairs [3, 2, 3, 2]
    q = [[[1.0, 2.0, 1.0, 1.0], [3.0, 1.0, 0.5, 1.0]]]
    lam = _fit(q, [[[4.0, 1.0, 9.0, 0.0]]], alpha=0.5, beta=1.0)
    assert lam.flatten().tolist() == [1.0, 0.5, 1.0, 0.5]


def test_gqa_groups_are_contiguous_query_heads():
    # query head j reads KV head j // 2: heads 0, 1 -> KV 0 (max 4), heads 2, 3 -> KV 1 (max 8); alpha 0 -> 1/max|Q|
    q = [[[1.0, 1.0], [4.0, 2.0], [2.0, 8.0], [1.0, 1.0]]]
    lam = _fit(q, [[[1.0, 1.0], [1.0, 1.0]]], alpha=0.0, beta=1.0)
    assert lam.tolist() == [[[0.25, 0.25], [0.125, 0.125]]]


def test_a_dead_pair_gets_lambda_one():
    lam = _fit([[[1.0, 1.0, 1.0, 1.0]]], [[[0.0, 2.0, 0.0, 8.0]]])
    assert lam.flatten().tolist() == pytest.approx([1.0, 8 ** 0.5, 1.0, 8 ** 0.5])
    # with beta > 0 a dead query pair carries nothing to balance either
    lam = _fit([[[0.0, 4.0, 0.0, 1.0]]], [[[9.0, 4.0, 9.0, 4.0]]], alpha=0.5, beta=0.5)
    assert lam.flatten().tolist() == pytest.approx([1.0, 1.0, 1.0, 1.0])


@pytest.mark.parametrize("field,value", [("alpha", 1.5), ("alpha", -0.1), ("beta", 2.0), ("beta", -1.0)])
def test_alpha_beta_outside_unit_interval_are_refused(field, value):
    cfg = SmoothConfig(**{field: value})
    with pytest.raises(ValueError, match=rf"smooth.{field} must be in \[0, 1\], got {value}"):
        smooth_attention.fit(smooth_attention.Inputs(torch.ones(1, 1, 4), torch.ones(1, 1, 4), "rotate_half"), cfg)


def test_unknown_rope_pairing_is_refused_by_name():
    with pytest.raises(ValueError, match="RoPE pairing must be one of \\('rotate_half',\\), got 'interleaved'"):
        smooth_attention.fit(smooth_attention.Inputs(torch.ones(1, 1, 4), torch.ones(1, 1, 4), "interleaved"), SmoothConfig())


@pytest.mark.parametrize("bad,beta", [(float("inf"), 0.0), (float("nan"), 0.0)])
def test_non_finite_lambda_names_layer_head_channel(bad, beta):
    k = torch.ones(2, 2, 4)
    k[1, 0, 3] = bad
    with pytest.raises(ValueError, match=r"layer 1, kv head 0, channel 1 \(RoPE pair 1/3"):
        smooth_attention.fit(smooth_attention.Inputs(torch.ones(2, 2, 4), k, "rotate_half"), SmoothConfig(beta=beta))


def test_a_zero_lambda_from_an_infinite_query_is_refused():
    q = torch.ones(1, 1, 4)
    q[0, 0, 2] = float("inf")
    with pytest.raises(ValueError, match=r"layer 0, kv head 0, channel 0 \(RoPE pair 0/2"):
        smooth_attention.fit(smooth_attention.Inputs(q, torch.ones(1, 1, 4), "rotate_half"), SmoothConfig(beta=1.0))


def _attention_logits(lm, ids, lam=None):
    """Per layer q.k^T after RoPE [H_q, T, T]: the model's own (lam None), or from pre-RoPE q * lambda and
    k / lambda rotated with the model's RoPE tables."""
    spec, d = lm.spec, lm.spec.head_dim
    pre: dict = {}
    post: dict = {}

    def grab(kind, layer):
        def hook(_m, _i, out):
            pre[kind, layer] = out[0].view(out.shape[1], -1, d).transpose(0, 1)  # [H, T, D]
        return hook

    def keep(module, query, key, value, mask, scaling):
        post[module.layer_idx] = (query[0], key[0])
        return sdpa_attention(query, key, value, mask, scaling)

    hooks = [(a.q_proj, grab("q", i), False) for i, a in enumerate(attention_layers(lm.model))]
    hooks += [(a.k_proj, grab("k", i), False) for i, a in enumerate(attention_layers(lm.model))]
    with torch.no_grad(), forward_hooks(hooks), attention_override(lm.model, keep):
        lm.model.model(ids, use_cache=False)
    rope = rope_tables(lm.model, ids)
    group = spec.n_q_heads // spec.n_kv_heads
    out = []
    for layer in range(spec.n_layers):
        if lam is None:
            q, k = post[layer]
        else:
            l_q = lam[layer].repeat_interleave(group, 0)[:, None]   # [H_q, 1, D]
            q = apply_rope((pre["q", layer] * l_q)[None], rope["cos"], rope["sin"])[0]
            k = apply_rope((pre["k", layer] / lam[layer][:, None])[None], rope["cos"], rope["sin"])[0]
        out.append(q @ k.repeat_interleave(group, 0).transpose(-1, -2))
    return torch.stack(out)


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max())


def _check_logits_equivalence(lm, windows):
    stats = traces.fit(traces.Inputs(lm.model, lm.spec, windows.calib[:, :32]), TracesConfig(reservoir_size=16)).tensors
    res = smooth_attention.fit(smooth_attention.Inputs(stats["q_absmax"], stats["k_pre_absmax"], lm.spec.rope_pairing), SmoothConfig())
    lam = res.tensors["smooth"]
    assert lam.std() > 0  # a non-trivial transform
    ids = windows.eval[:1, :64]
    plain, smoothed = _attention_logits(lm, ids), _attention_logits(lm, ids, lam)
    assert _rel(smoothed, plain) < 1e-5
    # the control: a lambda that breaks the RoPE pairs does not commute with RoPE
    broken = lam.clone()
    broken[..., 0] *= 2
    assert _rel(_attention_logits(lm, ids, broken), plain) > 1e-3
    return lam


def test_smoothing_leaves_attention_logits_unchanged_tiny(tiny, tiny_windows):
    _check_logits_equivalence(tiny, tiny_windows)


def test_folding_lambda_into_the_projections_keeps_the_logits(tiny, tiny_windows):
    lam = torch.rand(tiny.spec.n_layers, tiny.spec.n_kv_heads, tiny.spec.head_dim // 2) + 0.5
    lam = torch.cat([lam, lam], -1)
    folded = copy.deepcopy(tiny.model)
    smooth_attention.fold(folded, lam, tiny.spec.n_q_heads)
    ids = tiny_windows.eval[:1]
    with torch.no_grad():
        ref, out = tiny.model(ids).logits, folded(ids).logits
    assert _rel(out, ref) < 1e-5
    # the folded model's keys are K / lambda
    w = tiny.model.model.layers[0].self_attn.k_proj.weight
    wf = folded.model.layers[0].self_attn.k_proj.weight
    assert torch.allclose(wf, w / lam[0].reshape(-1)[:, None])


@pytest.mark.slow
def test_smoothing_leaves_attention_logits_unchanged_embedded(smollm2):
    from pipeline.config import DataConfig
    from pipeline.data import build_windows

    windows = build_windows(DataConfig(n_samples=2, seq_len=64, eval_n_samples=1, eval_seq_len=64), smollm2.tokenizer)
    lam = _check_logits_equivalence(smollm2, windows)
    assert float(lam.max() / lam.min()) > 4  # real key channels differ in scale: the transform is far from identity


@pytest.mark.parametrize("name,smooth,prefix", [("kvquant-3b-1pct+smooth", True, False),
                                                ("kvquant-3b-1pct+prefix", False, True),
                                                ("kvquant-3b-1pct+smooth+prefix", True, True),
                                                ("int4-token+smooth", True, False), ("fp16+prefix", False, True)])
def test_recipes_with_a_plus_in_the_name_compose_through_hydra(name, smooth, prefix):
    from hydra import compose, initialize_config_dir

    from pipeline.config import CONF_DIR, load_recipe, register_configs, to_typed

    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = to_typed(compose(config_name="config", overrides=[f"quant={name}", "smooth.alpha=0.25"]))
    assert (cfg.quant.name, cfg.quant.smooth, cfg.quant.prefix, cfg.smooth.alpha) == (name, smooth, prefix, 0.25)
    base = load_recipe(name.split("+")[0])
    assert (cfg.quant.key, cfg.quant.value, cfg.quant.key_rope, cfg.quant.n_sink) == \
        (base.key, base.value, base.key_rope, base.n_sink)
