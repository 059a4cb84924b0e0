"""Sliding-window (local) layers in the serving cache: a local layer never holds more than its window -- the rows
the newest token attends (plus, for per-channel key groups, the rest of the oldest group) -- and what it holds is
exactly what a cache without the window holds for those positions; the byte ledger predicts it; and a model with
local and global layers (tiny Gemma 3) decodes through the cache as through its own attention."""
import pytest
import torch

from exporters.codec import CachePolicy, TensorPolicy
from exporters.ledger import layer_bytes
from exporters.served_rows import layer_rows
from serving.blockwise import serving
from serving.cache import ArtifactCache, ArtifactLayer
from stages.base import InputError

H, D, WINDOW = 2, 8, 8


def _layer(policy, window, page=4):
    return ArtifactLayer(0, policy, rope_fn=None, max_positions=1 << 16, window=window, page=page)


def _ledger(policy, t, window):
    pk, pv = policy.layers[0]
    return layer_bytes(layer_rows(policy, 0, window), pk, pv, t, H, D)


POLICIES = {
    "uniform-token": CachePolicy("u4", [(TensorPolicy(format="uniform", bits=4, axis="token"),
                                         TensorPolicy(format="uniform", bits=4, axis="token"))], n_sink=2, residual=3),
    "kivi-groups": CachePolicy("kivi", [(TensorPolicy(format="uniform", bits=2, axis="channel", group_size=4),
                                         TensorPolicy(format="uniform", bits=2, axis="token"))], n_sink=1, residual=2),
    "fp16": CachePolicy("fp16", [(TensorPolicy(), TensorPolicy())], n_sink=1),
}


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_a_local_layer_holds_its_window_and_what_a_global_layer_holds_there(name):
    policy = POLICIES[name]
    local, full = _layer(policy, WINDOW), _layer(policy, None)
    g = torch.Generator().manual_seed(0)
    group = local.rows.unit
    t = 0
    for n in [5, 1, 1, 3, 1, 1, 9, 1, 1, 1, 1, 2, 1, 1, 1, 1, 1, 1, 1, 4, 1, 1]:
        k, v = torch.randn(1, H, n, D, generator=g), torch.randn(1, H, n, D, generator=g)
        offset = local.mask_offset(t)
        kv_len, kv_off = local.get_mask_sizes(n)
        got_k, got_v = local.update(k, v)
        ref_k, ref_v = full.update(k, v)
        t += n
        # what this step's queries may read: positions offset.. (transformers' sliding-mask frame), as stored
        assert (kv_off, kv_len) == (offset, t - offset) and got_k.shape[2] == t - offset
        assert torch.equal(got_k, ref_k[:, :, offset:]) and torch.equal(got_v, ref_v[:, :, offset:])
        # between steps: the last WINDOW positions, and the rest of the oldest group at most
        held = t - local.start
        assert local.start == max(0, t - WINDOW) or (group > 1 and 0 <= t - WINDOW - local.start < group)
        assert held <= WINDOW + group - 1
        assert local.nbytes() == _ledger(policy, t, WINDOW), t
        assert full.nbytes() == _ledger(policy, t, None), t
    assert t > 3 * WINDOW and local.sink is None  # the sink rows left the window long ago


def test_a_window_that_cannot_hold_the_residual_buffer_is_refused():
    policy = CachePolicy("r", [(TensorPolicy(format="uniform", bits=4, axis="token"),) * 2], residual=8)
    with pytest.raises(InputError, match=r"sliding window of 8 positions cannot hold the residual buffer of 8 rows "
                                         r"plus a flush unit of 1 .*got 8 \+ 1 > 8"):
        _layer(policy, 8)


def _fp16_policy(n_layers):
    return CachePolicy("fp16", [(TensorPolicy(), TensorPolicy())] * n_layers, n_sink=1)


def test_tiny_gemma3_decodes_through_the_cache_as_through_its_own_attention(tiny_gemma3):
    """fp16 rows, decoded one token at a time past the window: the logits are the model's own on the whole sequence
    (up to the fp16 rounding of K and V), each local layer holds its window, each global layer every row."""
    lm = tiny_gemma3
    model, windows = lm.model, [16 if t == "sliding" else None for t in lm.spec.layer_types]
    ids = torch.randint(3, 1000, (2, 44), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(ids).logits
        for mode in ("materialize", "blockwise"):
            cache = ArtifactCache(_fp16_policy(lm.spec.n_layers), model, attention=mode)
            assert cache.is_sliding == [w is not None for w in windows]
            steps = []
            with serving(model, cache) if mode == "blockwise" else torch.no_grad():
                steps.append(model(ids[:, :20], cache=cache).logits)
                for i in range(20, ids.shape[1]):
                    steps.append(model(ids[:, i : i + 1], cache=cache).logits)
                    for layer, w in zip(cache.layers, windows):
                        held = layer.cumulative_length - layer.start
                        assert held == (min(w, i + 1) if w else i + 1), (mode, i)
            got = torch.cat(steps, 1)
            assert torch.allclose(got, ref, atol=2e-3, rtol=1e-3), (mode, float((got - ref).abs().max()))


@pytest.mark.parametrize("grouped", [False, True])
def test_tiny_gemma3_quantized_cache_blockwise_equals_materialize(tiny_gemma3, grouped):
    """A quantized cache (per-token 4-bit rows or KIVI-like per-channel key groups, a residual window, a sink) read
    block-wise through the local layers' masks gives the materializing cache's logits (the same stored bytes, read
    two ways; with groups, the rows of the oldest group left in a local layer are masked out by both)."""
    lm = tiny_gemma3
    p = TensorPolicy(format="uniform", bits=4, axis="token")
    k = TensorPolicy(format="uniform", bits=4, axis="channel", group_size=4) if grouped else p
    policy = CachePolicy("u4", [(k, p)] * lm.spec.n_layers, n_sink=2, residual=4)
    ids = torch.randint(3, 1000, (1, 40), generator=torch.Generator().manual_seed(2))
    out = {}
    with torch.no_grad():
        for mode in ("keep-all", "materialize", "blockwise"):
            cache = ArtifactCache(policy, lm.model, attention="materialize" if mode == "keep-all" else mode,
                                  prefill="stored")
            if mode == "keep-all":  # the reference: the same bytes, every row kept, the model's sliding mask
                for layer in cache.layers:
                    layer.window, layer.is_sliding = None, False
            with serving(lm.model, cache) if mode == "blockwise" else torch.no_grad():
                logits = [lm.model(ids[:, :24], cache=cache).logits]
                logits += [lm.model(ids[:, i : i + 1], cache=cache).logits for i in range(24, 40)]
            out[mode] = torch.cat(logits, 1)
            held = cache.layers[0].cumulative_length - cache.layers[0].start  # local layer 0: its window
            assert held == 40 if mode == "keep-all" else (held == 16 or (grouped and 16 < held < 16 + 4))
    assert torch.allclose(out["materialize"], out["keep-all"], atol=1e-4, rtol=1e-4)  # float summation order
    assert torch.allclose(out["blockwise"], out["materialize"], atol=1e-4, rtol=1e-4)
