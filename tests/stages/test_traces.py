import numpy as np
import pytest
import torch

from stages.traces import TracesConfig
from stages import traces
from stages.base import NonFiniteError


def test_moments_hand_checked():
    m = traces._Moments(n_layers=1, n_heads=1, head_dim=2)
    m.update(0, torch.tensor([[[1.0, -2.0]], [[3.0, 4.0]]]))  # [T=2, H=1, D=2]
    m.update(0, torch.tensor([[[-1.0, 0.0]]]))
    out = m.tensors("k", count=3)
    assert out["k_min"].flatten().tolist() == [-1.0, -2.0]
    assert out["k_max"].flatten().tolist() == [3.0, 4.0]
    assert out["k_absmax"].flatten().tolist() == [3.0, 4.0]
    assert torch.allclose(out["k_mean"].flatten(), torch.tensor([1.0, 2.0 / 3.0]))
    # population std of [1, 3, -1] = sqrt(8/3); of [-2, 4, 0] = sqrt(56/9)
    assert torch.allclose(out["k_std"].flatten(), torch.tensor([(8 / 3) ** 0.5, (56 / 9) ** 0.5]))


def test_reservoir_fills_then_samples_uniformly():
    gen = np.random.default_rng(0)
    slots, offsets = traces.reservoir_slots(0, 5, size=8, gen=gen)
    assert slots.tolist() == [0, 1, 2, 3, 4] and offsets.tolist() == [0, 1, 2, 3, 4]
    # after the reservoir is full, each of n items survives with probability size/n
    hits = np.zeros(40)
    for trial in range(400):
        g = np.random.default_rng(trial)
        content = list(range(10))
        for start in range(10, 40, 10):
            s, o = traces.reservoir_slots(start, 10, size=10, gen=g)
            for slot, off in zip(s.tolist(), o.tolist()):
                content[slot] = start + off
        hits[content] += 1
    rate = hits / 400  # expected 10/40 = 0.25 for every item
    assert abs(rate.mean() - 0.25) < 1e-9 and rate.min() > 0.15 and rate.max() < 0.35


def _reservoir_slots_loop(n_seen, n_new, size, gen):
    """The per-item Algorithm R the vectorised reservoir_slots replaced: the reference it must match bit for bit."""
    writes: dict[int, int] = {}
    for i in range(n_new):
        g = n_seen + i
        r = g if g < size else int(gen.integers(0, g + 1))
        if r < size:
            writes[r] = i
    return list(writes.keys()), list(writes.values())


@pytest.mark.parametrize("n_seen,n_new,size", [(0, 5, 8), (0, 8, 8), (3, 10, 8), (10, 10, 10), (0, 300, 7),
                                               (6, 1, 7), (0, 0, 4), (4096 * 3, 8192, 4096), (2**33, 50, 7)])
def test_reservoir_slots_is_bit_identical_to_the_loop(n_seen, n_new, size):
    for seed in range(3):
        ref_gen, gen = np.random.default_rng(seed), np.random.default_rng(seed)
        want = _reservoir_slots_loop(n_seen, n_new, size, ref_gen)
        slots, offsets = traces.reservoir_slots(n_seen, n_new, size, gen)
        assert slots.dtype == offsets.dtype == torch.int64
        assert (slots.tolist(), offsets.tolist()) == want
        assert gen.bit_generator.state == ref_gen.bit_generator.state  # the next window draws the same numbers


def test_reservoir_slots_at_millions_of_tokens_is_fast():
    import time
    gen = np.random.default_rng(0)
    start = time.perf_counter()
    slots, offsets = traces.reservoir_slots(4_000_000, 2_000_000, 4096, gen)
    assert time.perf_counter() - start < 5.0  # the per-item loop took ~2 s per million items here
    assert len(slots) == len(set(slots.tolist())) and 0 < len(slots) <= 4096
    assert int(offsets.max()) < 2_000_000


def _direct_projections(model, ids):
    """k_proj / v_proj outputs computed by hooks that the test owns: the stage must agree with them."""
    keys, values, queries = {}, {}, {}
    hs = []
    for i, layer in enumerate(model.model.layers):
        hs.append(layer.self_attn.k_proj.register_forward_hook(lambda m, a, o, i=i: keys.__setitem__(i, o[0].clone())))
        hs.append(layer.self_attn.v_proj.register_forward_hook(lambda m, a, o, i=i: values.__setitem__(i, o[0].clone())))
        hs.append(layer.self_attn.q_proj.register_forward_hook(lambda m, a, o, i=i: queries.__setitem__(i, o[0].clone())))
    with torch.no_grad():
        model(ids[None])
    for h in hs:
        h.remove()
    return keys, values, queries


def test_traces_on_tiny_model_match_direct_activations(tiny, tiny_windows):
    spec, windows = tiny.spec, tiny_windows.calib
    res = traces.fit(traces.Inputs(tiny.model, spec, windows), TracesConfig(reservoir_size=32, n_first_positions=4, down_top_k=5))
    t = res.tensors
    assert t["k_pre_max"].shape == (spec.n_layers, spec.n_kv_heads, spec.head_dim)
    assert t["q_absmax"].shape == (spec.n_layers, spec.n_q_heads, spec.head_dim)
    direct = [_direct_projections(tiny.model, w) for w in windows]
    d = spec.head_dim
    for layer in range(spec.n_layers):
        all_k = torch.cat([k[layer] for k, *_ in direct]).view(-1, spec.n_kv_heads, d)
        assert torch.allclose(t["k_pre_max"][layer], all_k.amax(0), atol=1e-5)
        assert torch.allclose(t["k_pre_min"][layer], all_k.amin(0), atol=1e-5)
        assert torch.allclose(t["k_pre_mean"][layer], all_k.mean(0), atol=1e-5)
        all_q = torch.cat([q[layer] for _, _, q in direct]).view(-1, spec.n_q_heads, d)
        assert torch.allclose(t["q_meansq"][layer], all_q.square().mean(0), rtol=1e-4, atol=1e-6)
    # every reservoir row is the activation of its (sample, position)
    assert t["res_k"].shape[0] == 32
    for r in range(32):
        s, p = int(t["res_sample"][r]), int(t["res_pos"][r])
        k_dir, v_dir, _ = direct[s]
        assert torch.allclose(t["res_k"][r, 1].flatten(), k_dir[1][p], atol=1e-5)
        assert torch.allclose(t["res_v"][r, 0].flatten(), v_dir[0][p], atol=1e-5)
    # attention mass: probabilities, so within [0, 1]; position 0 is read by every query
    mass = t["attn_first_mass"]
    assert mass.shape == (spec.n_layers, spec.n_q_heads, 4) and (mass >= 0).all() and (mass <= 1 + 1e-6).all()
    # down_proj top-k tokens are real ids at their positions
    s, layer = 1, 0
    assert torch.equal(t["down_token"][s, layer], windows[s][t["down_pos"][s, layer]])
    assert (t["down_ratio"] >= 1 - 1e-6).all()


def test_attention_mass_stride_one_is_exact(tiny, tiny_windows):
    w = tiny_windows.calib[:1]
    exact = traces.fit(traces.Inputs(tiny.model, tiny.spec, w), TracesConfig(reservoir_size=4, n_first_positions=2, mass_query_stride=1))
    # hand-computed from the eager attention probabilities of the model itself
    tiny.model.config._attn_implementation = "eager"
    with torch.no_grad():
        out = tiny.model(w, output_attentions=True)
    tiny.model.config._attn_implementation = "sdpa"
    probs = out.attentions[0][0]  # [H_q, T, T]
    t = probs.shape[-1]
    expected = probs[:, :, 0].sum(-1) / t
    assert torch.allclose(exact.tensors["attn_first_mass"][0, :, 0], expected, atol=1e-5)


def test_memory_is_bounded_by_the_reservoir(tiny, tiny_windows):
    small = traces.fit(traces.Inputs(tiny.model, tiny.spec, tiny_windows.calib[:1]), TracesConfig(reservoir_size=16))
    large = traces.fit(traces.Inputs(tiny.model, tiny.spec, tiny_windows.calib), TracesConfig(reservoir_size=16))
    assert small.tensors["res_k"].shape == large.tensors["res_k"].shape


def test_nan_activation_names_layer_and_tensor(tiny, tiny_windows):
    layer = tiny.model.model.layers[1].self_attn.v_proj
    handle = layer.register_forward_hook(lambda m, a, o: o.index_fill(-1, torch.tensor([0]), float("nan")))
    try:
        with pytest.raises(NonFiniteError, match=r"layer 1 v_proj output"):
            traces.fit(traces.Inputs(tiny.model, tiny.spec, tiny_windows.calib[:1]), TracesConfig(reservoir_size=4))
    finally:
        handle.remove()
