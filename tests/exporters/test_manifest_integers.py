"""Integers typed as integers: every integer field of the schema (derived from the schema itself: `type`
integer, or an enum / const of integers) refuses a float equal to an integer (4.0) and a boolean, written into a
real artifact's manifest.json and re-signed as a tool that recomputes the digest would write it, with an error
naming the field, 'integer' and the value given (docs/manifest.md: a consumer must refuse 1.0 where the schema
says integer). The binding to the tensor file compares numbers by value (1 == 1.0), so it is the schema's type
that must refuse them."""
import copy
import json

import pytest

from exporters import manifest as mf
from exporters.native import parse_artifact, update_manifest, write_artifact
from pipeline.config import load_recipe
from stages.recipe import build_policy

ANY = "*"   # an array item or a member of an object with free member names


def _resolve(node: dict, root: dict) -> dict:
    while "$ref" in node:
        node = root["$defs"][node["$ref"].removeprefix("#/$defs/")]
    return node


def _is_integer(node: dict) -> bool:
    types = node.get("type", [])
    types = [types] if isinstance(types, str) else types
    values = node.get("enum", [node["const"]] if "const" in node else [])
    return "integer" in types or bool(values) and all(type(v) is int for v in values)


def integer_fields(node: dict, root: dict, path: tuple = ()) -> list[tuple]:
    """Every place in the schema that holds an integer, as a path pattern (ANY for array items and free members)."""
    node = _resolve(node, root)
    out = [path] if _is_integer(node) else []
    for name, sub in node.get("properties", {}).items():
        out += integer_fields(sub, root, path + (name,))
    if isinstance(node.get("additionalProperties"), dict):
        out += integer_fields(node["additionalProperties"], root, path + (ANY,))
    if "items" in node:
        out += integer_fields(node["items"], root, path + (ANY,))
    for branch in node.get("oneOf", []) + node.get("anyOf", []) + node.get("allOf", []):
        out += integer_fields(branch, root, path)
    return sorted(set(out))


def walk(obj, prefix=()):
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for k, v in items:
        yield prefix + (k,), v
        yield from walk(v, prefix + (k,))


def matches(pattern: tuple, path: tuple) -> bool:
    return len(pattern) == len(path) and all(p in (ANY, q) for p, q in zip(pattern, path))


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory, export_recipe, records, tiny, tiny_gemma3):
    """(manifest bytes, tensor bytes, model spec) of two real artifacts that between them fill every optional
    field: the tiny model's smoothed prefix recipe with the informative records, and the tiny Gemma 3 (sliding
    layers: model.attention) with a full calibration provenance."""
    path = export_recipe("kvquant-3b-1pct+smooth+prefix", tmp_path_factory.mktemp("int") / "prefix",
                         records["evaluation"])
    update_manifest(path, runtime_check=records["runtime_check"], gate=records["gate"])
    out = [(path, tiny.spec)]
    spec = tiny_gemma3.spec
    policy = build_policy(load_recipe("kivi-2"), spec.n_layers, {})
    data = {"description": "embedded", "calib_sha256": "a" * 64, "eval_sha256": "b" * 64, "n_samples": 2,
            "seq_len": 48, "seed": 0, "eval_n_samples": 1, "eval_seq_len": 48}
    man, tensors = mf.build_manifest(policy, spec, {"data": data, "stages": {}})
    out.append((write_artifact(tmp_path_factory.mktemp("int") / "gemma3", man, tensors), spec))
    return [((p / "manifest.json").read_bytes(), (p / mf.TENSOR_FILE).read_bytes(), s) for p, s in out]


def test_the_schema_lists_the_integer_fields():
    """The walk finds the integer fields a reader of the schema sees, those given by an enum or const too."""
    fields = integer_fields(mf.schema(), mf.schema())
    for f in [("format_version",), ("layers", ANY, "key", "bits"), ("layers", ANY, "value", "bits"),
              ("layers", ANY, "index"), ("model", "attention", "sliding_window"), ("tokenizer", "bos_token_id"),
              ("cache", "prefix", "token_ids", ANY), ("tensors", ANY, "shape", ANY),
              ("runtime_check", "cases", ANY, "worst_layer"), ("calibration", "data", "seed")]:
        assert f in fields


def test_an_integer_enum_or_const_says_type_integer():
    """For other languages' validators too: an enum or const of integers alone accepts 4.0 (JSON Schema compares
    numbers by value), so each such field also states its type."""
    root = mf.schema()

    def bare(node, path=()):
        node = _resolve(node, root)
        values = node.get("enum", [node["const"]] if "const" in node else [])
        out = [path] if values and all(type(v) is int for v in values) and node.get("type") != "integer" else []
        for name, sub in node.get("properties", {}).items():
            out += bare(sub, path + (name,))
        for sub in [node.get("additionalProperties"), node.get("items"), *node.get("oneOf", [])]:
            out += bare(sub, path + (ANY,)) if isinstance(sub, dict) else []
        return out

    assert bare(root) == []


def test_every_integer_field_refuses_a_float_and_a_boolean(artifacts):
    fields = integer_fields(mf.schema(), mf.schema())
    covered, wrong, tried = set(), [], 0
    for raw_m, raw_t, spec in artifacts:
        manifest = json.loads(raw_m)
        parse_artifact(raw_m, raw_t, spec)  # the original loads
        for path, value in walk(manifest):
            pattern = next((f for f in fields if matches(f, path)), None)
            if pattern is None:
                continue
            assert type(value) is int, (path, value)  # the exporter writes integers as integers
            covered.add(pattern)
            for bad in (float(value), value != 0):
                edited = copy.deepcopy(manifest)
                parent = edited
                for k in path[:-1]:
                    parent = parent[k]
                parent[path[-1]] = bad
                where = "/".join(map(str, path))
                tried += 1
                try:
                    parse_artifact(mf.serialize_manifest(edited), raw_t, spec)
                except mf.SchemaError as exc:
                    message = str(exc)
                    if not (f"manifest field {where}:" in message and "'integer'" in message and repr(bad) in message):
                        wrong.append(f"{where} = {bad!r}: {message}")
                except mf.ManifestError as exc:
                    wrong.append(f"{where} = {bad!r}: {type(exc).__name__}: {exc}")
                else:
                    wrong.append(f"{where} = {bad!r}: loaded")
    assert covered == set(fields), f"no artifact holds {sorted(set(fields) - covered)}"
    assert tried > 2 * len(fields)
    assert not wrong, "\n".join(wrong)
