import json
import threading
from dataclasses import replace

import pytest
import torch

from exporters import manifest as mf
from exporters import native
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


def build(spec, evaluation=None):
    policy = make_policy(spec.n_layers, spec.n_kv_heads, spec.head_dim)
    man, tensors = mf.build_manifest(policy, spec, {"data": {"n_samples": 2}},
                                     evaluation or {"kvquant-3b-1pct": {"ppl": 1.0}})
    return man, tensors, policy


def write_one(tmp_path, spec, name="a"):
    man, tensors, policy = build(spec)
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
    assert man["format_version"] == 2 and man["tensor_file"]["sha256"] != "0" * 64
    assert (path / "manifest.json").read_bytes().startswith(b'{\n "manifest_digest": "')


def test_the_prefix_ids_travel_as_a_tensor(make_artifact, tiny):
    a = load_artifact(make_artifact("kvquant-3b-1pct+prefix"), tiny.spec)
    ids = a.manifest["cache"]["prefix"]["token_ids"]
    assert a.tensors["prefix.ids"].dtype == torch.int64 and a.policy.prefix_ids.tolist() == ids
    assert a.policy.prefix_len == len(ids) >= 1


def test_existing_artifact_is_not_overwritten(tmp_path, tiny):
    path, _ = write_one(tmp_path, tiny.spec)
    before = (path / "manifest.json").read_bytes()
    man, tensors, _ = build(tiny.spec)
    with pytest.raises(ArtifactExistsError, match="already exists"):
        write_artifact(path, man, tensors)
    assert (path / "manifest.json").read_bytes() == before
    write_artifact(path, man, tensors, overwrite=True)
    assert [p.name for p in tmp_path.iterdir()] == ["a"]


def test_a_failed_write_leaves_nothing(tmp_path, tiny):
    man, tensors, _ = build(tiny.spec)
    tensors["layers.0.key.codebook"] = torch.zeros(3)  # inconsistent with the manifest: refused at write
    with pytest.raises(mf.ManifestError):
        write_artifact(tmp_path / "x", man, tensors)
    assert list(tmp_path.iterdir()) == []


def test_an_edit_without_a_new_digest_is_refused(tmp_path, tiny):
    path, _ = write_one(tmp_path, tiny.spec)
    text = (path / "manifest.json").read_text()
    (path / "manifest.json").write_text(text.replace('"n_sink": 1', '"n_sink": 0'))
    with pytest.raises(mf.ChecksumError, match="changed after it was written"):
        load_artifact(path)
    (path / "manifest.json").write_text(text.replace('"ppl": 1.0', '"ppl": 0.5'))  # informative fields too
    with pytest.raises(mf.ChecksumError, match="changed after it was written"):
        load_artifact(path)


@pytest.mark.parametrize("edit,error", [
    (lambda m: m.update(format="other.format"), mf.UnknownFormatError),
    (lambda m: m.update(format_version=1), mf.VersionMismatchError),
    (lambda m: m["layers"][0]["key"].update(bits=5), mf.SchemaError),
    (lambda m: m["cache"].update(key_rope="mid"), mf.SchemaError),
    (lambda m: m["tensors"]["layers.0.key.zero"].update(sha256="a" * 64), mf.ChecksumError),
    (lambda m: m["tensors"].pop("layers.1.value.codebook"), mf.MissingTensorError),
    (lambda m: m["layers"][1]["value"].update(bits=2), mf.TensorShapeError),
    (lambda m: m["tensors"]["smooth"].update(dtype="float16"), mf.TensorShapeError),
])
def test_each_cause_has_its_error(tmp_path, tiny, forge, edit, error):
    """Every checksum kept valid (forge), the header copy of the decoding fields rewritten too: the one check
    that owns the cause refuses."""
    path, _ = write_one(tmp_path, tiny.spec)
    forge(path, edit, rebind=True)
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


def test_update_manifest_records_the_check(tmp_path, tiny, records):
    path, _ = write_one(tmp_path, tiny.spec)
    update_manifest(path, runtime_check=records["runtime_check"], gate=records["gate"])
    loaded = load_artifact(path).manifest
    assert loaded["runtime_check"] == records["runtime_check"] and loaded["gate"] == records["gate"]
    with pytest.raises(mf.SchemaError):
        update_manifest(path, runtime_check={**records["runtime_check"], "status": "maybe"})
    with pytest.raises(mf.SchemaError, match="may replace only"):
        update_manifest(path, cache={})
    assert load_artifact(path).manifest["runtime_check"] == records["runtime_check"]


def test_concurrent_updates_use_their_own_temporary_files(tmp_path, tiny, records, monkeypatch):
    """Before: every writer used manifest.json.tmp, so one writer's rename took the other's file away."""
    path, _ = write_one(tmp_path, tiny.spec)
    sources, errors = [], []
    real_replace = native.os.replace
    monkeypatch.setattr(native.os, "replace", lambda src, dst: (sources.append(str(src)), real_replace(src, dst)))

    def writer(i):
        try:
            for j in range(5):
                update_manifest(path, gate={**records["gate"], "failures": [f"writer {i} round {j}"]})
        except Exception as exc:  # noqa: BLE001 - any failure of a writer fails the test
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(sources) == len(set(sources)) == 20
    assert load_artifact(path).manifest["gate"]["failures"][0].startswith("writer ")
    assert sorted(p.name for p in path.iterdir()) == ["manifest.json", "tensors.safetensors"]


@pytest.mark.parametrize("exchange", [True, False])
def test_overwrite_never_shows_a_reader_a_missing_or_mixed_artifact(tmp_path, tiny, monkeypatch, exchange):
    """A reader loops load_artifact while the artifact is overwritten again and again. With renameat2
    (RENAME_EXCHANGE) every load succeeds and is one whole version; the fallback (two renames) is checked only
    for its result, since the folder is briefly absent between its renames."""
    path, _ = write_one(tmp_path, tiny.spec)
    versions = [build(tiny.spec, {"kvquant-3b-1pct": {"ppl": float(i)}})[:2] for i in range(2)]
    swaps = []
    real = native._exchange

    def spy(a, b):
        swaps.append(exchange and real(a, b))
        return swaps[-1]

    monkeypatch.setattr(native, "_exchange", spy)
    stop, seen, errors = threading.Event(), [], []

    def reader():
        while not stop.is_set():
            try:
                a = load_artifact(path)
                seen.append(a.manifest["evaluation"]["kvquant-3b-1pct"]["ppl"])
            except Exception as exc:  # noqa: BLE001 - recorded, asserted below
                errors.append(exc)

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        for i in range(20):
            write_artifact(path, *versions[i % 2], overwrite=True)
    finally:
        stop.set()
        thread.join()
    assert swaps == [exchange] * 20
    assert load_artifact(path).manifest["evaluation"]["kvquant-3b-1pct"]["ppl"] == 1.0
    assert [p.name for p in tmp_path.iterdir()] == ["a"]
    if exchange:
        assert not errors, errors[:3]
        assert seen and set(seen) <= {0.0, 1.0}
