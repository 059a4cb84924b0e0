"""Each cross-check of docs/manifest.md ("a consumer must refuse when ..."): an edit that keeps every checksum
and the digest valid (the forge fixture) is refused with its own error class, and the message names the field,
what is allowed and what was given."""
import json
from dataclasses import replace

import pytest
import torch

from exporters import manifest as mf
from exporters.native import load_artifact

PREFIXED = "kvquant-3b-1pct+smooth+prefix"
ROT = "kvquant-2b-1pct+sink16+recent32+rotclipv"   # nuq keys with outliers; uniform values rotated and clipped


def _set(path, value):
    """An edit of the manifest dict: the field at path ("a/b/0/c") set to value, or deleted when value is DELETE."""
    def edit(m):
        *head, last = [int(p) if p.isdigit() else p for p in path.split("/")]
        for p in head:
            m = m[p]
        if value is DELETE:
            del m[last]
        else:
            m[last] = value
    return edit


DELETE = object()


@pytest.mark.parametrize("recipe,path,value,error,message", [
    (PREFIXED, "layers/0/key/outliers/rule", "none", mf.OutlierRuleError,
     r"layers/0/key/outliers/rule: .* allowed 'static_channel_bounds', got 'none'"),
    (PREFIXED, "layers/1/value/outliers/rule", "static_channel_bounds", mf.OutlierRuleError,
     r"allowed 'per_token_quantile', got 'static_channel_bounds'"),
    (PREFIXED, "layers/0/value/outliers/fraction", 0.0, mf.OutlierRuleError, r"allowed 'none', got 'per_token_quantile'"),
    ("fp8-e4m3", "layers/0/key/outliers/fraction", 0.01, mf.OutlierRuleError,
     r"layers/0/key/outliers/fraction: format fp8 stores no sparse outliers; allowed 0, got 0.01"),
    ("kvquant-3b", "layers/0/key/outliers/expected_fraction", 0.01, mf.OutlierRuleError,
     r"expected_fraction: allowed only when outliers are stored"),
    (PREFIXED, "layers/0/key/zero_point", "min", mf.ZeroPointError,
     r"layers/0/key/zero_point: format nuq allows 'midpoint', got 'min'"),
    ("kivi-2", "layers/1/value/zero_point", "none", mf.ZeroPointError, r"format uniform allows 'min', got 'none'"),
    ("fp8-e4m3", "layers/0/value/zero_point", "midpoint", mf.ZeroPointError, r"format fp8 allows 'none'"),
    (PREFIXED, "layers/0/key/zero_point", DELETE, mf.SchemaError, r"'zero_point' is a required property"),
    ("fp8-e4m3", "layers/0/key/fp8_dtype", DELETE, mf.Fp8DtypeError,
     r"layers/0/key/fp8_dtype: format fp8 allows one of \['e4m3', 'e5m2'\], got '\(absent\)'"),
    ("kivi-2", "layers/0/key/fp8_dtype", "e4m3", mf.Fp8DtypeError, r"format uniform allows no fp8_dtype field"),
    ("fp8-e4m3", "layers/0/key/bits", 4, mf.QuantFieldError, r"layers/0/key/bits: format fp8 allows \[8\], got 4"),
    ("kivi-2", "layers/0/key/group_size", 0, mf.QuantFieldError,
     r"group_size: format uniform with axis channel allows an integer >= 1 .*, got 0"),
    ("kivi-2", "layers/0/value/group_size", 32, mf.QuantFieldError, r"axis token allows 0 .*, got 32"),
    ("fp8-e4m3", "layers/0/key/axis", "token", mf.QuantFieldError, r"axis: format fp8 allows \['tensor', 'head'\]"),
    (PREFIXED, "layers/0/key/tensors/zero", "layers.1.key.zero", mf.TensorRefError,
     r"layers/0/key/tensors: .* allow exactly .*'zero': 'layers.0.key.zero'"),
    (PREFIXED, "layers/0/value/tensors/lower", "layers.0.key.lower", mf.TensorRefError, r"layers/0/value/tensors"),
    (PREFIXED, "cache/smoothing/tensor", "prefix.k", mf.TensorRefError, r"cache/smoothing: allowed \{'tensor': 'smooth'\}"),
    (ROT, "layers/0/key/rotation", "hadamard", mf.RotationError,
     r"layers/0/key/rotation: allowed only on values of format uniform with axis token and no sparse outliers "
     r"\(outliers/fraction 0\); got 'hadamard' on a key of format nuq with axis channel and outliers/fraction 0.01"),
    (ROT, "layers/1/key/clip", "mse", mf.RotationError,
     r"layers/1/key/clip: allowed only on values of format uniform with axis token; got 'mse' on a key of format nuq"),
    ("kvquant-3b", "layers/0/value/rotation", "hadamard", mf.RotationError,
     r"layers/0/value/rotation: allowed only on values .*; got 'hadamard' on a value of format nuq with axis token"),
    ("kvquant-3b", "layers/1/value/clip", "mse", mf.RotationError,
     r"layers/1/value/clip: allowed only on values of format uniform with axis token; got 'mse' on a value of format "
     r"nuq with axis token"),
    ("kivi-2", "layers/0/value/clip", "mse", None, None),   # clip alone on uniform values: carried
    (ROT, "layers/0/value/rotation", "none", mf.SchemaError,
     r"manifest field layers/0/value/rotation: 'none' is not one of \['hadamard'\]"),
    (ROT, "layers/0/value/clip", "none", mf.SchemaError, r"layers/0/value/clip: 'none' is not one of \['mse'\]"),
    (ROT, "layers/0/value/rotation", DELETE, mf.TensorRefError,
     r"layers/0/value/tensors: format uniform, axis token, outlier fraction 0.0, rotation none allow exactly \{\}"),
    (ROT, "layers/0/value/tensors/rotation_signs", "layers.1.value.rotation_signs", mf.TensorRefError,
     r"layers/0/value/tensors: .*rotation hadamard allow exactly "
     r"\{'rotation_signs': 'layers.0.value.rotation_signs'\}"),
    (ROT, "layers/1/value/tensors/rotation_signs", DELETE, mf.TensorRefError, r"layers/1/value/tensors: .*got \{\}"),
])
def test_a_field_that_contradicts_another_is_refused(make_artifact, forge, recipe, path, value, error, message):
    artifact = make_artifact(recipe)
    forge(artifact, _set(path, value), rebind=True)
    if error is None:
        load_artifact(artifact)
        return
    with pytest.raises(error, match=message):
        load_artifact(artifact)


def test_rotation_with_outliers_is_refused(make_artifact, forge):
    artifact = make_artifact(ROT)
    forge(artifact, lambda m: m["layers"][0]["value"].update(outliers={"fraction": 0.01, "rule": "per_token_quantile"}),
          rebind=True)
    with pytest.raises(mf.RotationError, match=r"layers/0/value/rotation: .*no sparse outliers .*; got 'hadamard' on a "
                                               r"value of format uniform with axis token and outliers/fraction 0.01"):
        load_artifact(artifact)


def test_rotated_values_round_trip_with_their_signs(make_artifact, tiny):
    """A rotclipv artifact loads back to the policy that was exported: rotation, clip and the signs (the seeded
    ones for b = head_dim & -head_dim, float32, under their canonical name); the keys carry neither."""
    from exporters.rotation import rht_signs

    art = load_artifact(make_artifact(ROT), tiny.spec)
    b = tiny.spec.head_dim & -tiny.spec.head_dim
    for i, (pk, pv) in enumerate(art.policy.layers):
        layer = art.manifest["layers"][i]
        assert (pv.rotation, pv.clip, pk.rotation, pk.clip) == ("hadamard", "mse", "none", "none")
        assert torch.equal(pv.rotation_signs, rht_signs(b)) and pk.rotation_signs is None
        assert (layer["value"]["rotation"], layer["value"]["clip"]) == ("hadamard", "mse")
        assert "rotation" not in layer["key"] and "clip" not in layer["key"]
        assert layer["value"]["tensors"] == {"rotation_signs": f"layers.{i}.value.rotation_signs"}
        assert art.manifest["tensors"][f"layers.{i}.value.rotation_signs"]["shape"] == [b]
        assert art.manifest["tensors"][f"layers.{i}.value.rotation_signs"]["dtype"] == "float32"


def test_an_artifact_without_rotation_has_no_rotation_members(make_artifact):
    """rotation / clip were added within format v2 as optional members: an artifact without them is written as
    before (no member "none", no signs tensor)."""
    for recipe in ("kvquant-2b+sink16+recent32", "kivi-2"):
        raw = (load_artifact(make_artifact(recipe)).path / "manifest.json").read_text()
        assert '"rotation"' not in raw and '"clip"' not in raw and "rotation_signs" not in raw


@pytest.mark.parametrize("edit,error,message", [
    (lambda t: t.update({"layers.0.value.rotation_signs": torch.ones(8)}), mf.TensorShapeError,
     r"tensor 'layers.0.value.rotation_signs': shape \(8,\) \(declared \(16,\)\); the manifest fields imply \(16,\)"),
    (lambda t: t.pop("layers.1.value.rotation_signs"), mf.MissingTensorError,
     r"tensor 'layers.1.value.rotation_signs' is missing from tensors.safetensors"),
])
def test_the_signs_tensor_has_the_rotations_block(make_artifact, forge, edit, error, message):
    artifact = forge(make_artifact(ROT), edit_tensors=edit)
    with pytest.raises(error, match=message):
        load_artifact(artifact)


def test_a_rotated_value_whose_signs_are_not_declared_is_refused(make_artifact, forge):
    artifact = forge(make_artifact(ROT), lambda m: m["tensors"].pop("layers.0.value.rotation_signs"),
                     lambda t: t.pop("layers.0.value.rotation_signs"))
    with pytest.raises(mf.MissingTensorError, match=r"tensor 'layers.0.value.rotation_signs' is referenced by the "
                                                    r"manifest but not declared"):
        load_artifact(artifact)


def test_the_writer_refuses_what_the_artifact_does_not_carry(tiny):
    """build_manifest applies the same rule by side: rotated keys, a nuq clip, signs of another length."""
    import dataclasses

    from exporters.codec import CachePolicy, TensorPolicy

    v = TensorPolicy(format="uniform", bits=2, axis="token", rotation="hadamard", clip="mse")
    for pair, error, message in [
        ((v, v), mf.RotationError, r"layers\.0\.key\.rotation: rotation hadamard is evaluation-only on keys"),
        ((TensorPolicy(), dataclasses.replace(v, rotation="none", format="nuq", codebook=torch.linspace(-1, 1, 4))),
         mf.RotationError, r"layers\.0\.value\.clip: clip mse is evaluation-only on values of format nuq"),
        ((TensorPolicy(), dataclasses.replace(v, rotation_signs=torch.ones(8))), mf.TensorShapeError,
         r"layers/0/value/tensors/rotation_signs: model/head_dim 16 implies \[16\], got shape \[8\]"),
    ]:
        with pytest.raises(error, match=message):
            mf.build_manifest(CachePolicy("r", [pair, (TensorPolicy(), TensorPolicy())]), tiny.spec, {"data": {}})


@pytest.mark.parametrize("path,value,message", [
    ("cache/n_sink", 0, r"manifest field cache/n_sink is 0, but tensors.safetensors .* was written for 1"),
    ("cache/residual", 128, r"cache/residual is 128"),
    ("cache/key_rope", "post", r"cache/key_rope is 'post'"),
    ("layers/1/value/outliers/fraction", 0.02, r"layers/1/value/outliers/fraction is 0.02"),
    ("layers/0/key/bits", 4, r"layers/0/key/bits is 4"),
    ("model/rope/theta", 500000.0, r"model/rope/theta is 500000.0"),
    ("model/max_positions", 8192, r"model/max_positions is 8192"),
    ("cache/prefix/token_ids/0", 7, r"cache/prefix/token_ids/0 is 7"),
    ("recipe", "kvquant-4b-1pct", r"recipe is 'kvquant-4b-1pct'"),
])
def test_a_decoding_field_must_match_the_tensor_file_header(make_artifact, forge, path, value, message):
    """What binds n_sink and the other decoding fields: the copy written into the tensor file's header at export
    (covered by tensor_file.sha256). A tool that edits manifest.json and re-signs its digest is refused."""
    artifact = make_artifact(PREFIXED)
    forge(artifact, _set(path, value))
    with pytest.raises(mf.BindingError, match=message):
        load_artifact(artifact)


def test_the_prefix_ids_must_match_the_prefix_tensor(make_artifact, forge, tiny):
    artifact = make_artifact(PREFIXED)
    with pytest.raises(mf.ModelMismatchError, match=r"model/vocab_size=49152; the model given has model/vocab_size=1"):
        load_artifact(artifact, replace(tiny.spec, vocab_size=1))

    def made_before_vocab_size(m):  # an artifact that records no vocab_size: the prefix ids still bound by the model
        del m["model"]["vocab_size"]

    forge(artifact, made_before_vocab_size, rebind=True)
    load_artifact(artifact, tiny.spec)
    with pytest.raises(mf.ModelMismatchError, match=r"the model given has 1 tokens, got id 1"):
        load_artifact(artifact, replace(tiny.spec, vocab_size=1))
    forge(artifact, _set("cache/prefix/token_ids/0", 7), rebind=True)  # header rewritten too: the tensor disagrees
    with pytest.raises(mf.PrefixError, match=r"cache/prefix/token_ids \[7.*\] differ from the prefix.ids tensor"):
        load_artifact(artifact)
    artifact = make_artifact("kvquant-3b-1pct+prefix")

    def other_ids(t):
        t["prefix.ids"] = t["prefix.ids"] + 1

    forge(artifact, edit_tensors=other_ids)
    with pytest.raises(mf.PrefixError, match="differ from the prefix.ids tensor"):
        load_artifact(artifact)


@pytest.mark.parametrize("field,value", [
    ("rope_theta", 500000.0), ("rope_scaling", json.dumps({"rope_type": "linear", "factor": 2.0})),
    ("rope_pairing", "interleaved"), ("max_positions", 8192), ("vocab_size", 32000), ("architecture", "MistralForCausalLM"),
    ("n_q_heads", 8), ("bos_token_id", 0), ("tokenizer_sha256", "e" * 64),
])
def test_the_served_model_must_be_the_calibrated_one(make_artifact, tiny, field, value):
    artifact = make_artifact(PREFIXED)
    load_artifact(artifact, tiny.spec)
    with pytest.raises(mf.ModelMismatchError, match=r"calibrated for model tiny with .*; the model given has"):
        load_artifact(artifact, replace(tiny.spec, **{field: value}))


def test_the_check_and_gate_records_must_support_their_status(make_artifact, forge, records):
    artifact = make_artifact("int4-token")
    rc, gate = records["runtime_check"], records["gate"]
    bad_case = {**rc["cases"][0], "ok": False}
    for edit, error, message in [
        (lambda m: m.update(runtime_check={**rc, "cases": [bad_case]}), mf.RecordError,
         r"runtime_check/status: 1 cases, 1 not ok, no error, canary ok allow 'failed', got 'passed'"),
        (lambda m: m.update(runtime_check={**rc, "canary": {**rc["canary"], "ok": False}}), mf.RecordError,
         r"runtime_check/status: 1 cases, 0 not ok, no error, canary failed allow 'failed', got 'passed'"),
        (lambda m: m.update(runtime_check={**rc, "cases": []}), mf.RecordError, r"0 cases, 0 not ok"),
        (lambda m: m.update(runtime_check={**rc, "error": "kernel raised"}), mf.RecordError, r"an error, canary ok allow 'failed'"),
        (lambda m: m.update(runtime_check={**rc, "max_abs_err": 0.0}), mf.RecordError,
         r"runtime_check/max_abs_err: the maximum over cases is 1.5e-06, got 0.0"),
        (lambda m: m.update(runtime_check={**rc, "cases": [{**rc["cases"][0], "ok": "yes"}]}), mf.SchemaError,
         r"runtime_check"),
        (lambda m: m.update(runtime_check={**rc, "status": True}), mf.SchemaError, r"runtime_check"),
        (lambda m: m.update(runtime_check={**rc, "verdict": "fine"}), mf.SchemaError, r"runtime_check"),
        (lambda m: m.update(gate={**gate, "passed": True}), mf.RecordError, r"gate/passed: 1 failures allow False"),
        (lambda m: m.update(gate={**gate, "passed": "no"}), mf.SchemaError, r"gate"),
        (lambda m: m.update(evaluation={"int4-token": {**records["evaluation"]["int4-token"], "ppl": "21.5"}}),
         mf.SchemaError, r"evaluation/int4-token/ppl"),
        (lambda m: m.update(evaluation={"int4-token": {"ppl_ratio_ci95": [1.0]}}), mf.SchemaError, r"ppl_ratio_ci95"),
        (lambda m: m.update(evaluation={"int4-token": {"perplexity": 2.0}}), mf.SchemaError, r"evaluation/int4-token"),
        (lambda m: m["calibration"].update(data={"n_samples": "8"}), mf.SchemaError, r"calibration/data/n_samples"),
    ]:
        forge(artifact, edit)
        with pytest.raises(error, match=message):
            load_artifact(artifact)
        forge(artifact, lambda m: (m.update(runtime_check=rc, gate=gate, evaluation=records["evaluation"]),
                                   m["calibration"].update(data={})))
        load_artifact(artifact)


def test_a_repeated_member_name_is_refused(make_artifact):
    artifact = make_artifact("int4-token")
    text = (artifact / "manifest.json").read_text()
    (artifact / "manifest.json").write_text(text.replace('"n_sink": 0,', '"n_sink": 0, "n_sink": 4,'))
    with pytest.raises(mf.SchemaError, match=r"repeats member names \['n_sink'\]"):
        load_artifact(artifact)


def test_the_schema_enums_are_the_registrys_exported_formats():
    """The schema (a static file for other languages) lists what exporters.codec.FORMATS exports: formats, axes,
    bits and zero points; a format registered for export without a schema change fails here."""
    policy = mf.schema()["$defs"]["tensor_policy"]["properties"]
    exported = mf.EXPORTED.values()
    assert policy["format"]["enum"] == list(mf.EXPORTED)
    assert set(policy["axis"]["enum"]) == {a for f in exported for a in f.export_axes}
    assert set(policy["bits"]["enum"]) == {b for f in exported for b in f.bits}
    assert set(policy["zero_point"]["enum"]) == {f.zero_point for f in exported}
    from exporters.codec import CALIBRATED_FIELDS, CLIPS, ROTATIONS
    # rotation / clip: absent means "none", so the schema lists only the others (an explicit "none" is refused)
    assert policy["rotation"]["enum"] == [r for r in ROTATIONS if r != "none"]
    assert policy["clip"]["enum"] == [c for c in CLIPS if c != "none"]
    assert list(policy["tensors"]["properties"]) == list(CALIBRATED_FIELDS)
