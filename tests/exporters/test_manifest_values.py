"""An artifact from a stranger, re-signed so that every checksum and the digest hold: the loader still refuses
values no decoder can use (exporters.manifest.check_values), shapes whose int16 outlier index would wrap, a
manifest nested deeper than MAX_DEPTH, and does no work proportional to a claimed n_layers (issue 51, items 2, 3,
5 and 6)."""
import json
import time

import pytest
import torch

from exporters import manifest as mf
from exporters.artifact import MANIFEST_FILE, read_manifest
from exporters.native import load_artifact

KVQ = "kvquant-3b-1pct+smooth+prefix"   # nuq per channel: codebook, zero, range, lower, upper; smooth; prefix
FP8 = "fp8-e4m3"                       # fp8 per tensor: fp8_scale
ROT = "kvquant-2b+sink16+recent32+rotclipv"   # rotated uniform values: rotation_signs


def _set(name, index, value):
    def edit(tensors):
        t = tensors[name].clone()
        t.view(-1)[index] = value
        tensors[name] = t
    return edit


@pytest.mark.parametrize("recipe, name, index, value, says", [
    (KVQ, "layers.0.key.range", 3, float("nan"), "finite"),
    (KVQ, "layers.1.key.zero", 0, float("inf"), "finite"),
    (KVQ, "layers.0.key.range", 5, -0.25, "range must be >= 0"),
    (KVQ, "layers.0.key.lower", 2, float("nan"), "finite"),
    (KVQ, "layers.0.key.lower", 2, 1e6, "lower must be <= upper"),
    (KVQ, "prefix.k", 7, float("nan"), "finite"),
    (KVQ, "prefix.v", 1, 1e6, "within float16"),
    (KVQ, "smooth", 4, 0.0, "smoothing factors must be >= 5.96046e-08"),
    (FP8, "layers.0.key.fp8_scale", 0, 0.0, r"fp8 scale must be in \[1.33046e-10, 146.214\]"),
    (FP8, "layers.0.value.fp8_scale", 0, float("nan"), "finite"),
    (FP8, "layers.0.key.fp8_scale", 0, 1000.0, r"fp8 scale must be in \[1.33046e-10"),
    (ROT, "layers.0.value.rotation_signs", 3, 0.5,
     r"rotation_signs entries must be exactly \+1 or -1; 1 of 16 entries, first at \[3\]: 0.5"),
    (ROT, "layers.1.value.rotation_signs", 0, 0.0, r"rotation_signs entries must be exactly \+1 or -1"),
    (ROT, "layers.1.value.rotation_signs", 15, -2.0, r"rotation_signs entries must be exactly \+1 or -1"),
    (ROT, "layers.0.value.rotation_signs", 7, float("nan"), "finite"),
])
def test_a_re_signed_tensor_of_unusable_values_is_refused_naming_it(make_artifact, forge, recipe, name, index, value,
                                                                     says):
    path = forge(make_artifact(recipe), edit_tensors=_set(name, index, value))
    with pytest.raises(mf.TensorValueError, match=says) as err:
        load_artifact(path)
    assert repr(name) in str(err.value)


def test_a_constant_channel_range_of_zero_is_a_valid_artifact(make_artifact, forge):
    """range 0 is what calibration writes for a channel that never varied (it decodes to its zero-point)."""
    path = forge(make_artifact(KVQ), edit_tensors=_set("layers.0.key.range", 3, 0.0))
    assert float(load_artifact(path).tensors["layers.0.key.range"].view(-1)[3]) == 0.0


TINY = "1.401298464324817e-45"   # 1e-45 as float32 stores it: the smallest subnormal


@pytest.mark.parametrize("recipe, name, index, value, says", [
    (FP8, "layers.0.key.fp8_scale", 0, 1e-45, r"fp8 scale must be in \[1.33046e-10, 146.214\] \(fp16's smallest "
                                              rf"positive 2\^-24 / e4m3 max, fp16 max / e4m3 max\); 1 of 1 entries, "
                                              rf"first at \[\]: {TINY}"),
    (FP8, "layers.1.value.fp8_scale", 0, 1e-12, r"fp8 scale must be in \[1.33046e-10, .*: 9.99999996004197\de-13"),
    (KVQ, "smooth", 4, 1e-45, rf"smoothing factors must be >= 5.96046e-08 \(2\^-24, .*first at \[0, 0, 4\]: "
                              rf"{TINY}"),
    (KVQ, "smooth", 9, 1e-30, r"smoothing factors must be >= 5.96046e-08 .*first at \[0, 0, 9\]: 1.00000000317\d*e-30"),
    (KVQ, "layers.1.key.range", 3, 1e-45, rf"range must be 0 \(a constant channel\) or a normal float32 >= "
                                          rf"1.17549e-38 \(2\^-126; .*first at \[0, 3\]: {TINY}"),
])
def test_a_subnormal_or_meaningless_scale_is_refused_naming_value_and_index(make_artifact, forge, recipe, name,
                                                                             index, value, says):
    """Issue 68, item 1: an fp8 scale of 1e-45 (a float32 subnormal) and a subnormal smoothing factor loaded (the
    second failed at the first flush). Refused at load: subnormal, or below the floor where the value means
    nothing (an fp8 scale whose largest decoded value is below float16's smallest positive; a lambda below it)."""
    path = forge(make_artifact(recipe), edit_tensors=_set(name, index, value))
    with pytest.raises(mf.TensorValueError, match=says) as err:
        load_artifact(path)
    assert str(err.value).startswith(f"tensor {name!r}: ")


def test_a_tiny_normal_range_is_a_valid_artifact(make_artifact, forge):
    """A near-constant channel's range may be far below float16's resolution (quantiles interpolated between keys
    that differ in one bit): only 0 or a normal float32 is asked of it."""
    path = forge(make_artifact(KVQ), edit_tensors=_set("layers.0.key.range", 3, 2 * mf.F32_NORMAL))
    assert float(load_artifact(path).tensors["layers.0.key.range"].view(-1)[3]) == 2 * mf.F32_NORMAL


def test_equal_outlier_bounds_load_a_constant_channel(make_artifact, forge):
    """lower == upper is a channel that never varies (Gemma 3 270M: 3 of layer 0's 256 key channels are 0 on every
    token, bounds 0 and 0): it loads. Equal bounds on a channel that varies cost storage, which the serving cache
    caps at (1 + OUTLIER_MARGIN) x the declared count (tests/serving/test_cache.py); lower > upper stays refused."""
    def equal(tensors):
        lower = tensors["layers.1.key.lower"].clone()
        lower.view(-1)[5] = tensors["layers.1.key.upper"].view(-1)[5]
        tensors["layers.1.key.lower"] = lower

    path = forge(make_artifact(KVQ), edit_tensors=equal)
    t = load_artifact(path).tensors
    assert float(t["layers.1.key.lower"].view(-1)[5]) == float(t["layers.1.key.upper"].view(-1)[5])


def test_honest_calibration_has_ordered_bounds_and_no_meaningless_scales(calib, make_artifact):
    """What calibration writes (the keys' f/2 and 1 - f/2 quantiles per channel, lambda = sqrt(max|K|), fp8 scales
    amax / fp8_max) is far from every floor, and the artifacts built from it load."""
    for which in ("plain", "smooth"):
        c = calib[which]
        assert bool((c["upper"] > c["lower"]).all()) and bool((c["range"] >= mf.F32_NORMAL).all())
    assert bool((calib["smooth"]["smooth"] >= mf.FP16_TINY).all())
    for recipe in (KVQ, FP8, "kvquant-4b-1pct"):
        load_artifact(make_artifact(recipe))


def _resign(path, edit):
    man = json.loads((path / MANIFEST_FILE).read_text())
    edit(man)
    (path / MANIFEST_FILE).write_bytes(mf.serialize_manifest(man))


def test_a_huge_claimed_layer_count_is_refused_at_once(make_artifact):
    """n_layers = 200000000 with a short layers list: refused by the schema's maximum, in well under a second (it
    took 8 GB and 45 s), and the count check itself compares lengths first."""
    path = make_artifact(FP8)
    _resign(path, lambda m: m["model"].update(n_layers=200_000_000))
    start = time.perf_counter()
    with pytest.raises(mf.SchemaError, match="n_layers"):
        read_manifest(path)
    assert time.perf_counter() - start < 1.0
    man = read_manifest(make_artifact("kivi-2"))
    man["model"]["n_layers"] = 200_000_000
    start = time.perf_counter()
    with pytest.raises(mf.SchemaError, match="layers must list indices 0..199999999"):
        mf.check_fields(man)
    assert time.perf_counter() - start < 0.1


def _nested(path, depth: int) -> None:
    """model.rope.scaling.x = `depth` nested lists, written as text (json.dumps itself cannot go that deep) and
    signed by the spec's rule."""
    import hashlib

    man = json.loads((path / MANIFEST_FILE).read_text())
    man["model"]["rope"]["scaling"]["x"] = "NESTED"
    raw = mf.serialize_manifest(man).replace(b'"NESTED"', b"[" * depth + b"]" * depth)
    digest = json.loads(raw)[mf.DIGEST_FIELD] if depth < 500 else raw.split(b'"manifest_digest": "')[1][:64].decode()
    unsigned = raw.replace(digest.encode(), mf.UNSIGNED.encode())
    (path / MANIFEST_FILE).write_bytes(unsigned.replace(mf.UNSIGNED.encode(), hashlib.sha256(unsigned).hexdigest().encode(), 1))


@pytest.mark.parametrize("depth, refusal", [(mf.MAX_DEPTH - 6, "model/rope/scaling"), (40, "nesting deeper than 32"),
                                            (100_000, "not valid UTF-8 JSON")])
def test_deep_nesting_is_refused_before_any_recursive_reader(make_artifact, depth, refusal):
    """Nested lists in model.rope.scaling (it was exit 5: a RecursionError): within MAX_DEPTH the binding to the
    tensor file's header refuses the edit; deeper, the parse refuses it naming the field, before the schema or any
    comparison walks it; far deeper, the JSON parser's own limit refuses it."""
    path = make_artifact(FP8)
    _nested(path, depth)
    with pytest.raises(mf.ManifestError, match=refusal):
        load_artifact(path)


def test_outliers_on_a_model_whose_row_overflows_int16_are_refused():
    """h * head_dim + d is stored as int16: with sparse outliers n_kv_heads * head_dim must be <= 32767."""
    man = {"model": {"n_kv_heads": 64, "head_dim": 1024},
           "layers": [{"key": {"outliers": {"rule": "static_channel_bounds"}}, "value": {"outliers": {"rule": "none"}}}]}
    with pytest.raises(mf.ConsistencyError, match=r"layers/0/key/outliers.*64 \* 1024 = 65536"):
        mf._check_row_entries(man)
    man["layers"][0]["key"]["outliers"]["rule"] = "none"
    mf._check_row_entries(man)  # no outliers stored: no index, any shape
    man["model"]["head_dim"], man["layers"][0]["key"]["outliers"]["rule"] = 511, "static_channel_bounds"
    mf._check_row_entries(man)  # 64 * 511 = 32704 fits


def test_grouped_query_heads_must_divide(make_artifact):
    path = make_artifact(FP8)
    _resign(path, lambda m: m["model"].update(n_q_heads=m["model"]["n_kv_heads"] * 2 + 1))
    with pytest.raises(mf.ConsistencyError, match="n_q_heads must be a multiple of model/n_kv_heads"):
        read_manifest(path)


def test_the_loaded_policy_carries_the_model_binding(make_artifact, tiny):
    policy = load_artifact(make_artifact(FP8)).policy
    assert policy.model["n_kv_heads"] == tiny.spec.n_kv_heads and policy.model["head_dim"] == tiny.spec.head_dim
    assert policy.model["n_layers"] == tiny.spec.n_layers and policy.model["rope"]["theta"] == tiny.spec.rope_theta
    assert "sha256" not in policy.model and "name" not in policy.model
    assert torch.isfinite(policy.layers[0][0].fp8_scale).all()
