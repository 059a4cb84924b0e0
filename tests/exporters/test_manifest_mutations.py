"""Property: every mutation of a real artifact is refused with a ManifestError subclass, or provably harmless --
the loaded policy decodes a fixed K/V tensor bit-identically under every layer's key and value policy, and the
sequence-level fields (sinks, residual, RoPE stage and parameters, smoothing, prefix) are unchanged. Any other
exception fails the test, and so does a single silent acceptance.

Modes: byte flips / truncation / insertion in either file; JSON edits (delete a member, another value of the
same type, a value of another type, an added member) written without a new digest; and the same JSON edits
re-signed, as a tool that recomputes the digest would write them, so the cross-checks and the binding to the
tensor file are what refuses. Run with `pytest -s` to see the counts ("mutations: N refused R harmless H
silent S", then one line per mode)."""
import copy
import json
from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from exporters import manifest as mf
from exporters.codec import decode, encode
from exporters.native import parse_artifact, update_manifest

RECIPES = ["kvquant-3b-1pct+smooth+prefix", "kivi-2", "fp8-e4m3"]
MODES = ["manifest_bytes", "tensor_bytes", "json_unsigned", "json_resigned"]
WEIGHTED_MODES = MODES + ["json_resigned"] * 2  # half the examples: the edits only cross-checks can refuse
EDITS = ["delete", "same_type", "other_type", "add"]
EXAMPLES = 1200
# values of every JSON type, and member names a schema-aware edit would add
POOL = [None, True, False, 0, 1, -1, 3, 0.0, 0.5, -2.5, 1e30, "", "x", "none", "1", [], [0], [1.5, 2.5], {}, {"a": 1}]
NAMES = ["x", "expected_fraction", "fp8_dtype", "zero_point", "error", "ids", "ppl_seeds", "thresholds", "gate",
         "manifest_digest", "__metadata__", "tensor"]


def json_type(v) -> str:
    return {bool: "boolean", int: "integer", float: "number", str: "string", list: "array", dict: "object",
            type(None): "null"}[type(v)]


def walk(obj, prefix=()):
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for k, v in items:
        yield prefix + (k,), v
        yield from walk(v, prefix + (k,))


def signature(artifact, h: int, d: int):
    """What decoding depends on: every layer's key and value policy applied to one fixed K/V tensor (decoded
    values), and the sequence-level fields. Integers keep their type (a 1.0 would be a change)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, h, 40, d, generator=g) * torch.linspace(0.5, 4, d)  # 40 rows: a partial KIVI group too
    x[0, 0, 3, 5] = 40.0                                                  # an outlier row
    p = artifact.policy
    decoded = [decode(encode(x, tp), tp) for pair in p.layers for tp in pair]
    fields = [(tp.format, tp.bits, type(tp.bits), tp.axis, tp.group_size, type(tp.group_size),
               float(tp.outlier_fraction), tp.fp8_dtype if tp.format == "fp8" else None)
              for pair in p.layers for tp in pair]
    model = artifact.manifest["model"]
    ints = [p.n_sink, p.residual, p.prefix_len]
    return {"decoded": decoded, "smooth": p.smooth, "policy": fields,
            "cache": (p.name, p.key_rope, ints, [type(i) for i in ints],
                      None if p.prefix_ids is None else p.prefix_ids.tolist()),
            "model": (model["rope"], model["max_positions"], model["architecture"], model["head_dim"])}


def same(a, b) -> bool:
    tensors = all(torch.equal(x, y) for x, y in zip(a["decoded"], b["decoded"])) and len(a["decoded"]) == len(b["decoded"])
    smooth = (a["smooth"] is None) == (b["smooth"] is None) and (a["smooth"] is None or torch.equal(a["smooth"], b["smooth"]))
    return tensors and smooth and all(a[k] == b[k] for k in ("policy", "cache", "model"))


@pytest.fixture(scope="module")
def originals(tmp_path_factory, export_recipe, records, tiny):
    """Per recipe: (manifest bytes, tensor bytes, parsed manifest, every JSON path, signature), the informative
    fields filled as a pipeline run fills them."""
    out = []
    for recipe in RECIPES:
        evaluation = {**records["evaluation"], recipe: {**records["evaluation"]["int4-token"],
                                                        "outlier_fraction_k": 0.011, "outlier_fraction_v": 0.009}}
        path = export_recipe(recipe, tmp_path_factory.mktemp("mut") / recipe, evaluation)
        update_manifest(path, runtime_check=records["runtime_check"], gate=records["gate"])
        raw_m, raw_t = (path / "manifest.json").read_bytes(), (path / mf.TENSOR_FILE).read_bytes()
        artifact = parse_artifact(raw_m, raw_t, tiny.spec)
        paths = [p for p, _ in walk(artifact.manifest)]
        out.append((raw_m, raw_t, artifact.manifest, paths,
                    signature(artifact, tiny.spec.n_kv_heads, tiny.spec.head_dim)))
    return out


def mutate_bytes(data, raw: bytes) -> tuple[bytes, str]:
    op = data.draw(st.sampled_from(["flip", "truncate", "insert", "delete"]))
    at = data.draw(st.integers(0, len(raw) - 1))
    if op == "flip":
        return raw[:at] + bytes([raw[at] ^ data.draw(st.integers(1, 255))]) + raw[at + 1:], f"flip@{at}"
    if op == "truncate":
        return raw[:at], f"truncate@{at}"
    if op == "insert":
        return raw[:at] + bytes([data.draw(st.integers(0, 255))]) + raw[at:], f"insert@{at}"
    return raw[:at] + raw[at + 1:], f"delete@{at}"


def another_of_same_type(data, v, strings: list[str], ints: list[int]):
    if isinstance(v, bool):
        return not v
    if isinstance(v, int):
        options = [v + 1, v - 1, v + 2, v * 2 + 1, v + 100] + [i for i in ints if i != v]
    elif isinstance(v, float):
        options = [v * 2, v / 2, v + 0.5, -v - 0.25, 1.0, 0.0, v * (1 + 2 ** -40), v + 1e-12]
    elif isinstance(v, str):
        flipped = [v[:i] + ("0" if v[i] != "0" else "1") + v[i + 1:] for i in range(min(len(v), 64))]
        options = [v + "x", v[:-1], v.upper()] + flipped[:3] + [s for s in strings if s != v]
    elif isinstance(v, list):
        options = [v[:-1], v + v[-1:], v[::-1], []]
    elif isinstance(v, dict):
        options = [{k: x for k, x in v.items() if k != drop} for drop in v] + [{}]
    else:
        options = []
    options = [o for o in options if json.dumps(o) != json.dumps(v)]
    return data.draw(st.sampled_from(options)) if options else None


def edit_json(data, manifest: dict, paths: list, strings: list[str], ints: list[int]) -> tuple[dict, str]:
    """One edit at a path drawn evenly over the top-level fields, then over the paths under the one drawn."""
    m = copy.deepcopy(manifest)
    section = data.draw(st.sampled_from(sorted(manifest)))
    under = [p for p in paths if p[0] == section]
    path = under[data.draw(st.integers(0, len(under) - 1))]
    parent = m
    for k in path[:-1]:
        parent = parent[k]
    key, old = path[-1], parent[path[-1]]
    edit = data.draw(st.sampled_from(EDITS))
    if edit == "same_type":
        new = another_of_same_type(data, old, strings, ints)
        edit = "other_type" if new is None else edit  # null has no other value of its type
    if edit == "delete":
        del parent[key]
    elif edit == "same_type":
        parent[key] = new
    elif edit == "other_type":
        alike = [float(old)] if json_type(old) == "integer" else [int(old)] if json_type(old) == "number" and \
            float(old).is_integer() and abs(old) < 1e15 else []
        parent[key] = data.draw(st.sampled_from(alike + [v for v in POOL if json_type(v) != json_type(old)]))
    else:  # add: a member to the object at (or holding) the path, or an item to the array
        target = old if isinstance(old, (dict, list)) else parent
        value = data.draw(st.sampled_from(POOL + [copy.deepcopy(old)]))
        if isinstance(target, list):
            target.append(value)
        else:
            name = data.draw(st.sampled_from(NAMES + [f"x_{key}"]))
            target[name if name not in target else f"{name}_2"] = value
    return m, f"{edit} {'/'.join(map(str, path))}"


def test_mutations_are_refused_or_harmless(originals, tiny):
    counts = {mode: Counter() for mode in MODES}
    refusals, silent = Counter(), []
    h, d = tiny.spec.n_kv_heads, tiny.spec.head_dim

    @settings(max_examples=EXAMPLES, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(data=st.data())
    def run(data):
        raw_m, raw_t, manifest, paths, original = originals[data.draw(st.integers(0, len(originals) - 1))]
        mode = data.draw(st.sampled_from(WEIGHTED_MODES))
        if mode == "manifest_bytes":
            raw_m, what = mutate_bytes(data, raw_m)
        elif mode == "tensor_bytes":
            raw_t, what = mutate_bytes(data, raw_t)
        else:
            strings = sorted({v for _, v in walk(manifest) if isinstance(v, str)})
            ints = sorted({v for _, v in walk(manifest) if json_type(v) == "integer"})
            edited, what = edit_json(data, manifest, paths, strings, ints)
            raw_m = mf.serialize_manifest(edited) if mode == "json_resigned" else json.dumps(edited, indent=1).encode()
        try:
            loaded = parse_artifact(raw_m, raw_t, tiny.spec)
        except mf.ManifestError as exc:
            counts[mode]["refused"] += 1
            refusals[type(exc).__name__] += 1
            return
        if same(signature(loaded, h, d), original):
            counts[mode]["harmless"] += 1
        else:
            counts[mode]["silent"] += 1
            silent.append(f"{mode}: {what}")

    run()
    total = sum(counts.values(), Counter())
    print(f"\nmutations: {sum(total.values())} refused {total['refused']} harmless {total['harmless']} "
          f"silent {total['silent']}")
    for mode in MODES:
        c = counts[mode]
        print(f"  {mode}: {sum(c.values())} refused {c['refused']} harmless {c['harmless']} silent {c['silent']}")
    print(f"  refused by: {dict(refusals.most_common())}")
    assert not silent, silent[:10]
    assert sum(total.values()) >= 1000
