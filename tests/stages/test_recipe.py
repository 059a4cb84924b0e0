"""stages/recipe.py for vLLM's formats (conf/quant/vllm-*.yaml): each recipe loads and resolves to a policy with
no calibration, TurboQuant's boundary layers are fp16, the bits per element are the spec's, and a run's exported
recipe refuses them."""
import pytest
import torch

from exporters.codec import CodecError, fake_quant, stored_bits
from pipeline.config import load_recipe, recipe_names
from stages.recipe import QuantConfig, TensorQuantConfig
from stages import recipe

VLLM = ["vllm-int8-per-token-head", "vllm-fp8-per-token-head", "vllm-int4-per-token-head", "vllm-turboquant-k8v4",
        "vllm-turboquant-4bit-nc", "vllm-turboquant-k3v4-nc", "vllm-turboquant-3bit-nc"]
# (K bits, V bits) per element at D=64 and D=128: the spec's table (section 6)
BITS = {"vllm-int8-per-token-head": ((8.5, 8.5), (8.25, 8.25)),
        "vllm-fp8-per-token-head": ((8.5, 8.5), (8.25, 8.25)),
        "vllm-int4-per-token-head": ((4.5, 4.5), (4.25, 4.25)),
        "vllm-turboquant-k8v4": ((8.0, 4.5), (8.0, 4.25)),
        "vllm-turboquant-4bit-nc": ((4.25, 4.5), (4.125, 4.25)),
        "vllm-turboquant-k3v4-nc": ((3.25, 4.5), (3.125, 4.25)),
        "vllm-turboquant-3bit-nc": ((3.25, 3.5), (3.125, 3.25))}


def test_every_vllm_recipe_is_in_conf_quant():
    assert set(VLLM) <= set(recipe_names())


@pytest.mark.parametrize("name", VLLM)
def test_vllm_recipe_builds_a_policy_without_calibration(name):
    q = load_recipe(name)
    assert q.name == name and q.key_rope == "post" and q.n_sink == 0 and q.residual == 0
    assert not recipe.needs_calibration(q)
    policy = recipe.build_policy(q, 6, {})
    full = {0, 1, 4, 5} if "turboquant" in name else set()
    for i, (pk, pv) in enumerate(policy.layers):
        assert (pk.format == "fp16" and pv.format == "fp16") == (i in full), (i, pk.format)
    pk, pv = policy.layers[2]
    assert pk.calibrated() == {} and pv.calibrated() == {}
    for d, (k_bits, v_bits) in zip((64, 128), BITS[name]):
        assert stored_bits(pk, 1, 1, 1, d) / d == k_bits
        assert stored_bits(pv, 1, 1, 1, d) / d == v_bits
    x = torch.randn(1, 2, 5, 64, generator=torch.Generator().manual_seed(0)).half().float()
    for p in (pk, pv):   # the codec takes the policy as built
        assert torch.isfinite(fake_quant(x, p)[0]).all()


@pytest.mark.parametrize("n_layers,full", [(6, {0, 1, 4, 5}), (4, {0, 1, 2, 3}), (3, {0, 2}), (1, set())])
def test_full_precision_layers_are_the_first_and_last_n(n_layers, full):
    q = QuantConfig(name="x", key=TensorQuantConfig(format="uniform", bits=4, axis="token"),
                    value=TensorQuantConfig(format="uniform", bits=4, axis="token"), full_precision_layers=2)
    assert recipe.full_precision_layer_indices(q, n_layers) == full    # n = min(2, n_layers // 2), as vLLM
    layers = recipe.build_policy(q, n_layers, {}).layers
    assert {i for i, (k, v) in enumerate(layers) if k.is_full_precision and v.is_full_precision} == full


def test_full_precision_layers_must_not_be_negative():
    with pytest.raises(CodecError, match=r"quant.full_precision_layers must be >= 0, got -1"):
        recipe.validate_recipe(QuantConfig(name="x", full_precision_layers=-1))


@pytest.mark.parametrize("name", VLLM)
def test_a_vllm_recipe_cannot_be_exported(name):
    with pytest.raises(CodecError, match=r"quant\.key: format \w+ with axis \w+ is evaluation-only .*"
                                         r"take fp16 \(axis tensor\); uniform \(axis token\|channel\); nuq .*"
                                         r"fp8 \(axis tensor\|head\); got format="):
        recipe.check_exportable_recipe(load_recipe(name))


def test_our_recipes_can_be_exported():
    for name in ("fp16", "fp8-e4m3", "int4-token", "kivi-2", "kvquant-3b-1pct", "kvquant-2b+sink16+recent32+rotclipv",
                 "kvquant-2b-1pct+sink16+recent32+rotclipv"):
        recipe.check_exportable_recipe(load_recipe(name))


@pytest.mark.parametrize("name,field,given", [
    ("kvquant-3b-1pct+rot", r"quant\.key\.rotation", "on keys of format nuq with axis channel"),   # keys, before RoPE
    ("kvquant-3b-1pct+rotv", r"quant\.value\.rotation", "on values of format nuq with axis token"),
    ("kvquant-4b+rot", r"quant\.key\.rotation", "on keys of format nuq"),
    ("oscar-style-int2", r"quant\.key\.rotation", "on keys of format uniform with axis token"),   # post-RoPE keys
    ("kvquant-2b+sink16+recent32+clipv", r"quant\.value\.clip", "on values of format nuq with axis token"),
])
def test_rotations_and_clips_elsewhere_than_uniform_values_stay_evaluation_only(name, field, given):
    q = load_recipe(name)
    assert not recipe.is_exportable_recipe(q)
    with pytest.raises(CodecError, match=rf"^{field}: \w+ \w+ is evaluation-only {given}"):
        recipe.check_exportable_recipe(q)


def test_a_rotated_policy_holds_the_signs_its_artifact_stores():
    """With the abs-max in the calibration (every run has it), each rotated policy holds rht_signs(D & -D): the
    run's ledger (static_bits) counts the 32 * b bits per layer that the artifact stores; without it none."""
    from exporters.codec import static_bits
    from exporters.rotation import rht_signs

    q = load_recipe("kvquant-2b+sink16+recent32+rotclipv")
    q.key = TensorQuantConfig(format="uniform", bits=4, axis="token")
    absmax = {"k_absmax": torch.ones(3, 2, 96), "v_absmax": torch.ones(3, 2, 96)}   # D = 96: b = 32
    for pk, pv in recipe.build_policy(q, 3, absmax).layers:
        assert torch.equal(pv.rotation_signs, rht_signs(32)) and pk.rotation_signs is None
        assert static_bits(pv) == 32 * 32 and static_bits(pk) == 0
    assert all(pv.rotation_signs is None for _, pv in recipe.build_policy(q, 3, {}).layers)


@pytest.mark.parametrize("name,fields", [
    ("fp16", ["key.format", "value.format"]),   # nothing quantized: no bits, axis or key_rope to choose
    ("kvquant-4b+sink16+recent128", ["key.format", "key.bits", "key.axis", "value.format", "value.bits",
                                     "value.axis", "key_rope", "n_sink", "residual"]),
    ("kivi-2", ["key.format", "key.bits", "key.axis", "key.group_size", "value.format", "value.bits", "value.axis",
                "key_rope", "residual"]),   # group_size on the grouped (per-channel uniform) keys only
    ("fp8-e4m3", ["key.format", "key.axis", "key.fp8_dtype", "key.fp8_rounding", "value.format", "value.axis",
                  "value.fp8_dtype", "value.fp8_rounding", "key_rope"]),   # fp8 is 8 bits: no bits to choose
    ("kvquant-3b-1pct+smooth+prefix", ["key.format", "key.bits", "key.axis", "key.outlier_fraction", "value.format",
                                       "value.bits", "value.axis", "value.outlier_fraction", "key_rope", "n_sink",
                                       "smooth", "prefix"]),
    ("kvquant-2b+sink16+recent32+rotclipv", ["key.format", "key.bits", "key.axis", "value.format", "value.bits",
                                             "value.axis", "value.rotation", "value.clip", "key_rope", "n_sink",
                                             "residual"]),
    ("vllm-turboquant-k3v4-nc", ["key.format", "key.bits", "key.norm_correction", "value.format", "value.bits",
                                 "key_rope", "full_precision_layers"]),
    ("hf-hqq-2", ["engine.library", "engine.backend", "engine.nbits", "engine.axis_key", "engine.axis_value",
                  "engine.q_group_size", "engine.residual_length"]),   # the library's cache: its fields alone
])
def test_recipe_fields_are_the_ones_the_recipe_uses(name, fields):
    """What `show RUN_ID` lists of a recipe: its format's fields (an engine's only for a library's cache), the
    settings that are on, never a field the recipe leaves unused."""
    assert recipe.recipe_fields(load_recipe(name)) == fields


def test_every_shipped_recipe_lists_its_format_and_no_engine_field_unless_it_is_an_engine():
    for name in recipe_names():
        q, listed = load_recipe(name), recipe.recipe_fields(load_recipe(name))
        if q.engine.library:
            assert all(f.startswith("engine.") for f in listed), name
        else:
            assert listed[:1] == ["key.format"] and "value.format" in listed, name
            assert not any(f.startswith("engine.") for f in listed), name
