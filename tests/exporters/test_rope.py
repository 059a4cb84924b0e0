"""The consumer-side RoPE (exporters.rope, from the manifest's rope fields alone) against the model's own rotary
module: a pre-RoPE artifact of a llama3-scaled model (Llama 3.1 / llama3-shape) is rotated as the model rotates."""
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
    assert torch.allclose(ours.float(), rotary.inv_freq, rtol=1e-6, atol=0)
    plain = inv_frequencies(128, theta)
    assert (ours < plain * 0.99).any() and (ours == plain).any()  # low frequencies scaled, high ones kept
    # every band: kept (i small), smoothed (between) and divided by the factor (i large)
    ratio = (plain / ours).tolist()
    assert ratio[0] == 1.0 and abs(ratio[-1] - 8.0) < 1e-9 and any(1.0 < r < 8.0 for r in ratio)

    positions = torch.tensor([0, 1, 7, 1000, 8191, 8192, 20000, 131071])
    cos, sin = rope_cos_sin(positions, 128, theta, scaling)
    ref_cos, ref_sin = rotary(torch.zeros(1, len(positions), 1), positions[None])
    # the model's tables are float32 angles (p * f rounded): about p * 2^-24 radians off exact
    tol = 2e-7 * float(positions.max()) + 1e-6
    assert torch.allclose(cos, ref_cos[0], atol=tol) and torch.allclose(sin, ref_sin[0], atol=tol)
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
    assert torch.allclose(apply_rope(k_pre, cos, sin), apply_rope(k_pre, cos_m, sin_m), atol=1e-2)


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
