"""A consumer written from docs/manifest.md alone ("Integrity: digest, checksums, binding"): `verify` uses
nothing but hashlib, json and struct -- no project code, no safetensors library. It accepts real exported
artifacts and refuses tampered ones, and the project's loader agrees with it on each case."""
import hashlib
import json
import struct

import pytest

from exporters import manifest as mf
from exporters.native import load_artifact, update_manifest

SAFETENSORS_DTYPES = {"F32": ("float32", 4), "F16": ("float16", 2), "I64": ("int64", 8)}
BOUND = ("recipe", "model", "tokenizer", "cache", "layers")


class Refused(Exception):
    pass


def _unique(pairs):
    names = [name for name, _ in pairs]
    if len(names) != len(set(names)):
        raise Refused("a member name is repeated")
    return dict(pairs)


def _equal(a, b):
    """JSON value equality: numbers by value, booleans only with booleans."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    return type(a) is type(b) and a == b


def verify(folder) -> dict:
    """Every checksum of an artifact folder, as docs/manifest.md specifies them -> the manifest, or Refused."""
    with open(f"{folder}/manifest.json", "rb") as f:
        raw = f.read()
    m = json.loads(raw.decode("utf-8"), object_pairs_hook=_unique)
    if m.get("format") != "kvcalib.kv-cache" or m.get("format_version") != 2:
        raise Refused("unknown format or version")
    digest = m.get("manifest_digest")
    if not (isinstance(digest, str) and len(digest) == 64 and all(c in "0123456789abcdef" for c in digest)):
        raise Refused("manifest_digest is not 64 lowercase hex digits")
    if raw.count(digest.encode("ascii")) != 1:
        raise Refused("manifest_digest does not occur exactly once")
    if hashlib.sha256(raw.replace(digest.encode("ascii"), b"0" * 64)).hexdigest() != digest:
        raise Refused("manifest digest")
    with open(f"{folder}/{m['tensor_file']['name']}", "rb") as f:
        data = f.read()
    if hashlib.sha256(data).hexdigest() != m["tensor_file"]["sha256"]:
        raise Refused("tensor_file sha256")
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n].decode("utf-8"), object_pairs_hook=_unique)
    body = data[8 + n :]
    bound = json.loads(header.pop("__metadata__", {}).get("kvcalib.bound", "null"))
    if not isinstance(bound, dict) or not all(f in bound and _equal(m[f], bound[f]) for f in BOUND):
        raise Refused("binding: a decoding field differs from the tensor file's header")
    if set(header) != set(m["tensors"]):
        raise Refused("the file's tensors are not the declared ones")
    for name, entry in header.items():
        declared = m["tensors"][name]
        dtype, size = SAFETENSORS_DTYPES[entry["dtype"]]
        begin, end = entry["data_offsets"]
        count = 1
        for dim in entry["shape"]:
            count *= dim
        if dtype != declared["dtype"] or entry["shape"] != declared["shape"] or end - begin != count * size:
            raise Refused(f"tensor {name}: dtype or shape")
        if hashlib.sha256(body[begin:end]).hexdigest() != declared["sha256"]:
            raise Refused(f"tensor {name}: sha256")
    prefix = m["cache"]["prefix"]
    if prefix:
        begin, end = header[prefix["tensors"]["ids"]]["data_offsets"]
        if list(struct.unpack(f"<{(end - begin) // 8}q", body[begin:end])) != prefix["token_ids"]:
            raise Refused("prefix ids")
    return m


RECIPES = ["kvquant-3b-1pct+smooth+prefix", "fp8-e4m3", "kivi-2", "fp16+prefix"]


@pytest.mark.parametrize("recipe", RECIPES)
def test_a_consumer_from_the_spec_verifies_real_artifacts(make_artifact, records, recipe):
    path = make_artifact(recipe)
    m = verify(path)
    assert set(m["tensors"]) == set(load_artifact(path).tensors)
    assert bool(m["cache"]["prefix"]) == recipe.endswith("prefix") and (m["layers"][0]["key"]["format"] == "fp8") == \
        recipe.startswith("fp8")
    update_manifest(path, runtime_check=records["runtime_check"], gate=records["gate"])
    assert verify(path)["runtime_check"] == records["runtime_check"]


def _tamper_tensor_bytes(path, _forge):
    """One data byte of the file changed, the file's sha256 re-made and the manifest re-signed: only the
    per-tensor checksum is left to notice."""
    data = bytearray((path / mf.TENSOR_FILE).read_bytes())
    data[-1] ^= 0x01
    (path / mf.TENSOR_FILE).write_bytes(bytes(data))
    m = json.loads((path / "manifest.json").read_text())
    m["tensor_file"]["sha256"] = hashlib.sha256(bytes(data)).hexdigest()
    (path / "manifest.json").write_bytes(mf.serialize_manifest(m))


def _unsigned_edit(path, _forge):
    text = (path / "manifest.json").read_text()
    (path / "manifest.json").write_text(text.replace('"residual": 0', '"residual": 16'))


@pytest.mark.parametrize("tamper,reason,error", [
    (_unsigned_edit, "manifest digest", mf.ChecksumError),
    (_tamper_tensor_bytes, r"tensor \S+: sha256", mf.ChecksumError),
    (lambda path, forge: forge(path, lambda m: m["cache"].update(n_sink=0)), "binding", mf.BindingError),
    (lambda path, forge: forge(path, edit_tensors=lambda t: t.update({"prefix.ids": t["prefix.ids"] * 0})),
     "prefix ids", mf.PrefixError),
    (lambda path, forge: forge(path, lambda m: m["tensors"]["prefix.k"].update(shape=[2, 2, 1, 8]), rebind=True),
     "prefix.k: dtype or shape", mf.TensorShapeError),
])
def test_the_spec_consumer_and_the_loader_refuse_tampering(make_artifact, forge, tamper, reason, error):
    path = make_artifact("kvquant-3b-1pct+smooth+prefix")
    tamper(path, forge)
    with pytest.raises(Refused, match=reason):
        verify(path)
    with pytest.raises(error):
        load_artifact(path)
