import json
import shutil
from dataclasses import replace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from exporters import manifest as mf
from exporters.codec import CachePolicy, TensorPolicy
from exporters.native import ArtifactExistsError, load_artifact, update_manifest, write_artifact


def make_policy(n_layers=2, h=2, d=16) -> CachePolicy:
    g = torch.Generator().manual_seed(0)
    layers = []
    for i in range(n_layers):
        lower = -torch.rand(h, d, generator=g) - 0.5
        upper = torch.rand(h, d, generator=g) + 0.5
        k = TensorPolicy(format="nuq", bits=3, axis="channel", outlier_fraction=0.01,
                         codebook=torch.linspace(-1, 1, 8), zero=(upper + lower) / 2, range=(upper - lower) / 2,
                         lower=lower, upper=upper)
        v = TensorPolicy(format="nuq", bits=3, axis="token", outlier_fraction=0.01, codebook=torch.linspace(-1, 0.9, 8))
        layers.append((k, v))
    return CachePolicy("kvquant-3b-1pct", layers, key_rope="pre", n_sink=1, smooth=torch.rand(n_layers, h, d) + 0.5)


def write_one(tmp_path, spec, name="a"):
    policy = make_policy(spec.n_layers, spec.n_kv_heads, spec.head_dim)
    man, tensors = mf.build_manifest(policy, spec, {"data": {"n_samples": 2}}, {"kvquant-3b-1pct": {"ppl": 1.0}})
    return write_artifact(tmp_path / name, man, tensors), policy


def test_round_trip(tmp_path, tiny):
    path, policy = write_one(tmp_path, tiny.spec)
    a = load_artifact(path, tiny.spec)
    assert a.policy.name == policy.name and a.policy.key_rope == "pre" and a.policy.n_sink == 1
    for (k1, v1), (k2, v2) in zip(a.policy.layers, policy.layers):
        assert torch.equal(k1.codebook, k2.codebook) and torch.equal(k1.upper, k2.upper)
        assert (v1.format, v1.bits, v1.axis, v1.outlier_fraction) == (v2.format, v2.bits, v2.axis, v2.outlier_fraction)
    assert torch.equal(a.policy.smooth, policy.smooth)
    man = json.loads((path / "manifest.json").read_text())
    assert man["format_version"] == 1 and man["tensor_file"]["sha256"] != "0" * 64


def test_existing_artifact_is_not_overwritten(tmp_path, tiny):
    path, _ = write_one(tmp_path, tiny.spec)
    before = (path / "manifest.json").read_bytes()
    policy = make_policy(tiny.spec.n_layers, tiny.spec.n_kv_heads, tiny.spec.head_dim)
    man, tensors = mf.build_manifest(policy, tiny.spec, {}, {})
    with pytest.raises(ArtifactExistsError, match="already exists"):
        write_artifact(path, man, tensors)
    assert (path / "manifest.json").read_bytes() == before
    write_artifact(path, man, tensors, overwrite=True)
    assert [p.name for p in tmp_path.iterdir()] == ["a"]


def test_a_failed_write_leaves_nothing(tmp_path, tiny):
    policy = make_policy(tiny.spec.n_layers, tiny.spec.n_kv_heads, tiny.spec.head_dim)
    man, tensors = mf.build_manifest(policy, tiny.spec, {}, {})
    tensors["layers.0.key.codebook"] = torch.zeros(3)  # inconsistent with the manifest: refused at write
    with pytest.raises(mf.ManifestError):
        write_artifact(tmp_path / "x", man, tensors)
    assert list(tmp_path.iterdir()) == []


def _edit(path, fn):
    m = json.loads((path / "manifest.json").read_text())
    fn(m)
    (path / "manifest.json").write_text(json.dumps(m))


@pytest.mark.parametrize("edit,error", [
    (lambda m: m.update(format="other.format"), mf.UnknownFormatError),
    (lambda m: m.update(format_version=2), mf.VersionMismatchError),
    (lambda m: m["layers"][0]["key"].update(bits=5), mf.SchemaError),
    (lambda m: m["cache"].update(key_rope="mid"), mf.SchemaError),
    (lambda m: m["tensors"]["layers.0.key.zero"].update(sha256="a" * 64), mf.ChecksumError),
    (lambda m: m["tensors"].pop("layers.1.value.codebook"), mf.MissingTensorError),
    (lambda m: m["layers"][1]["value"].update(bits=2), mf.TensorShapeError),
    (lambda m: m["tensors"]["smooth"].update(dtype="float16"), mf.TensorShapeError),
])
def test_each_cause_has_its_error(tmp_path, tiny, edit, error):
    path, _ = write_one(tmp_path, tiny.spec)
    _edit(path, edit)
    with pytest.raises(error):
        load_artifact(path)


def test_tensor_file_tampering_and_model_mismatch(tmp_path, tiny):
    path, _ = write_one(tmp_path, tiny.spec)
    other = replace(tiny.spec, model_sha256="f" * 64)
    with pytest.raises(mf.ModelMismatchError, match="sha256"):
        load_artifact(path, other)
    data = bytearray((path / "tensors.safetensors").read_bytes())
    data[-3] ^= 0xFF
    (path / "tensors.safetensors").write_bytes(bytes(data))
    with pytest.raises(mf.ChecksumError):
        load_artifact(path)
    (path / "tensors.safetensors").unlink()
    with pytest.raises(mf.ManifestError, match="missing tensors.safetensors"):
        load_artifact(path)


def test_update_manifest_records_the_check(tmp_path, tiny):
    path, _ = write_one(tmp_path, tiny.spec)
    update_manifest(path, runtime_check={"status": "passed", "max_abs_err": 1e-6})
    assert load_artifact(path).manifest["runtime_check"]["status"] == "passed"
    with pytest.raises(mf.SchemaError):
        update_manifest(path, runtime_check={"status": "maybe"})


def _mutations():
    leaf = st.one_of(st.none(), st.booleans(), st.integers(-3, 70), st.floats(allow_nan=True), st.text(max_size=5),
                     st.lists(st.integers(0, 3), max_size=3), st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))
    return st.tuples(st.integers(0, 10_000), st.sampled_from(["replace", "delete", "add"]), leaf)


def _paths(obj, prefix=()):
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _paths(v, prefix + (i,))


@pytest.fixture(scope="module")
def pristine(tmp_path_factory, tiny):
    path, _ = write_one(tmp_path_factory.mktemp("pristine"), tiny.spec)
    return path


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mutation=_mutations())
def test_manifest_mutations_are_rejected_or_harmless(pristine, tmp_path_factory, mutation):
    path = tmp_path_factory.mktemp("mut") / "a"
    shutil.copytree(pristine, path)
    original = load_artifact(pristine)
    m = json.loads((path / "manifest.json").read_text())
    paths = [p for p in _paths(m) if p]
    pick, op, value = mutation
    target = paths[pick % len(paths)]
    parent = m
    for k in target[:-1]:
        parent = parent[k]
    key = target[-1]
    if op == "delete":
        parent.pop(key)
    elif op == "add" and isinstance(parent, dict):
        parent[f"x_{key}"] = value
    else:
        parent[key] = value
    (path / "manifest.json").write_text(json.dumps(m))
    try:
        loaded = load_artifact(path)
    except mf.ManifestError:
        return
    assert loaded.policy.name == original.policy.name and len(loaded.policy.layers) == len(original.policy.layers)
    for (k1, v1), (k2, v2) in zip(loaded.policy.layers, original.policy.layers):
        assert (k1.format, k1.bits, k1.axis, k1.outlier_fraction) == (k2.format, k2.bits, k2.axis, k2.outlier_fraction)
        assert (v1.format, v1.bits, v1.axis, v1.outlier_fraction) == (v2.format, v2.bits, v2.axis, v2.outlier_fraction)
    assert (loaded.policy.key_rope, loaded.policy.n_sink, loaded.policy.residual) == \
        (original.policy.key_rope, original.policy.n_sink, original.policy.residual)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(offset=st.integers(0, 10**9), flip=st.integers(1, 255), truncate=st.booleans())
def test_tensor_file_mutations_are_rejected(pristine, tmp_path_factory, offset, flip, truncate):
    path = tmp_path_factory.mktemp("tmut") / "a"
    shutil.copytree(pristine, path)
    data = bytearray((path / "tensors.safetensors").read_bytes())
    if truncate:
        data = data[: offset % len(data)]
    else:
        data[offset % len(data)] ^= flip
    (path / "tensors.safetensors").write_bytes(bytes(data))
    with pytest.raises(mf.ManifestError):
        load_artifact(path)
