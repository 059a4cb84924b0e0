"""The consumer-side RoPE (exporters.rope, from the manifest's rope fields alone) against the model's own rotary
module: a pre-RoPE artifact of a llama3-scaled model (Llama 3.1 / llama3-shape) is rotated as the model rotates --
to the bit, since both compute in float32 in the same order (docs/manifest.md, RoPE: precision)."""
import json

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from exporters.rope import apply_rope, inv_frequencies, rope_cos_sin, rotary_tables
from pipeline.shapes import shape_config


def _manifest_rope(config):
    """model.rope {theta, scaling} as pipeline.model.model_spec writes it (rope_parameters without rope_theta)."""
    rope = dict(config.rope_parameters)
    theta = float(rope.pop("rope_theta"))
    return theta, json.loads(json.dumps(rope, sort_keys=True))


def test_llama3_scaling_matches_transformers_rotary():
    config = shape_config("llama3-8b", 1)
    theta, scaling = _manifest_rope(config)
    assert scaling["rope_type"] == "llama3" and theta == 500000.0
    rotary = LlamaRotaryEmbedding(config)
    assert rotary.attention_scaling == 1.0
    ours = inv_frequencies(128, theta, scaling)
    assert ours.dtype == torch.float32 and torch.equal(ours, rotary.inv_freq)
    plain = inv_frequencies(128, theta)
    assert (ours < plain * 0.99).any() and (ours == plain).any()  # low frequencies scaled, high ones kept
    # every band: kept (i small), smoothed (between) and divided by the factor (i large)
    ratio = (plain / ours).tolist()
    assert ratio[0] == 1.0 and abs(ratio[-1] - 8.0) < 1e-9 and any(1.0 < r < 8.0 for r in ratio)

    positions = torch.tensor([0, 1, 7, 1000, 8191, 8192, 20000, 131071])
    cos, sin = rope_cos_sin(positions, 128, theta, scaling)
    ref_cos, ref_sin = rotary(torch.zeros(1, len(positions), 1), positions[None])
    # float32 angles p * f as the model's module computes them (float64 angles were up to p * 2^-24 rad off)
    assert torch.equal(cos, ref_cos[0]) and torch.equal(sin, ref_sin[0])
    plain_cos, _ = rope_cos_sin(positions, 128, theta)
    assert not torch.allclose(plain_cos, ref_cos[0], atol=1e-2)  # ignoring the scaling would decode wrong


def test_a_pre_rope_key_decoded_from_the_manifest_equals_the_models_rotation():
    config = shape_config("llama3-8b", 1)
    theta, scaling = _manifest_rope(config)
    rotary = LlamaRotaryEmbedding(config)
    k_pre = torch.randn(1, 8, 64, 128, generator=torch.Generator().manual_seed(0))  # [B, H_kv, T, D]
    start = 9000  # beyond the original 8192 positions, where the scaling matters most
    cos_m, sin_m = rotary_tables(rotary, start, 64)
    cos, sin = rope_cos_sin(torch.arange(start, start + 64), 128, theta, scaling)
    assert torch.equal(apply_rope(k_pre, cos, sin), apply_rope(k_pre, cos_m, sin_m))


def test_linear_and_default_scaling():
    assert torch.equal(inv_frequencies(16, 10000.0, {"rope_type": "default"}), inv_frequencies(16, 10000.0))
    assert torch.allclose(inv_frequencies(16, 10000.0, {"rope_type": "linear", "factor": 4.0}) * 4,
                          inv_frequencies(16, 10000.0))


@pytest.mark.parametrize("scaling,match", [
    ({"rope_type": "yarn", "factor": 4.0}, r"rope_type must be one of \('default', 'linear', 'llama3'\), got 'yarn'"),
    ({"rope_type": "llama3", "factor": 8.0}, r"missing \['low_freq_factor', 'high_freq_factor', 'original_max"),
    ({"rope_type": "linear"}, r"missing \['factor'\]"),
    ({"full_attention": {"rope_type": "default"}}, r"rope_type 'default' takes \['rope_type'\]; unknown fields "
                                                   r"\['full_attention'\]"),
    ({"rope_type": "default", "partial_rotary_factor": 0.5}, r"partial_rotary_factor must be 1.0 .*got 0.5"),
])
def test_unknown_or_incomplete_scaling_is_refused_by_name(scaling, match):
    with pytest.raises(ValueError, match=match):
        inv_frequencies(16, 10000.0, scaling)


def test_the_round_trip_is_exact_to_float32_rounding_for_bfloat16_keys():
    """The convention (docs/manifest.md, RoPE: precision): float32 tables, rotation in float32 on float32 copies
    of the keys, whatever their dtype. At D = 128, theta 5e5 (llama3 scaling), positions 0..8191, bfloat16 keys
    come back from invert_rope then apply_rope to float32 rounding; tables rounded to bfloat16 (what a bfloat16
    model's own rotary module returns) are not a rotation (cos^2 + sin^2 != 1) and move them by ~4e-3."""
    from exporters.rope import invert_rope

    rotary = LlamaRotaryEmbedding(shape_config("llama3-8b", 1))
    cos, sin = rotary_tables(rotary, 0, 8192)
    assert cos.dtype == sin.dtype == torch.float32 and cos.shape == (1, 8192, 128)
    k = (torch.randn(1, 8, 8192, 128, generator=torch.Generator().manual_seed(0)) * 2).to(torch.bfloat16)
    pre = invert_rope(k, cos, sin)
    assert pre.dtype == torch.float32  # the caller rounds to its storage dtype, after the rotation
    back = apply_rope(pre, cos, sin)
    rel = ((back - k.float()).norm(dim=-1) / k.float().norm(dim=-1)).max()
    assert rel <= 1e-6, float(rel)
    cos16, sin16 = rotary_tables(rotary, 0, 8192, torch.bfloat16)
    old = apply_rope(invert_rope(k, cos16, sin16), cos16, sin16)
    assert ((old - k.float()).norm(dim=-1) / k.float().norm(dim=-1)).max() > 1e-3
