"""Mutation campaign against the strict artifact loader (exporters/artifact.py parse_artifact).

Property: every mutation of a real artifact is refused with a ManifestError subclass, or is provably harmless
-- the loaded policy decodes a fixed K/V tensor bit-identically under every layer's key and value policy, and
the sequence-level fields (sinks, residual, RoPE stage and parameters, smoothing, prefix) are unchanged. Any
other exception is a crash; a single silent, harmful acceptance is a defect.

Modes: byte flips / truncation / insertion / deletion in either file; JSON edits (delete a member, another value
of the same type, a value of another type, an added member) written without a new digest; and the same JSON
edits re-signed, as a tool that recomputes the digest would write them, so that the schema, the cross-checks
and the binding to the tensor file are what refuses.

Two ways of choosing the mutations share everything else here:
- `enumerated`: a fixed list that edits every JSON path of an artifact with each kind of edit (and a fixed set
  of byte positions); tests/exporters/test_manifest_mutations.py runs it, so CI never depends on chance;
- `drawn`: a seeded random campaign, this module's command line:

    python -m bench.manifest_mutations --examples N [--seed S] [--json PATH] [--recipes NAME ...]

  builds the tiny model's artifacts with the pipeline (embedded text, evaluation, drift gate and runtime check
  on, so every informative field is filled as a run fills it), draws N mutations with random.Random(S), prints
  the counts (tried, refused, harmless, silent and harmful; per mode and per refusal class) and exits 1 if any
  mutation was accepted silently and changed what decodes.
"""
from __future__ import annotations

import argparse
import copy
import json
import random
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from exporters import manifest as mf
from exporters.artifact import parse_artifact
from exporters.codec import decode, encode

RECIPES = ("kvquant-3b-1pct+smooth+prefix", "kivi-2", "fp8-e4m3")
MODES = ("manifest_bytes", "tensor_bytes", "json_unsigned", "json_resigned")
WEIGHTED_MODES = MODES + ("json_resigned",) * 2  # half the draws: the edits only cross-checks can refuse
EDITS = ("delete", "same_type", "other_type", "add")
BYTE_OPS = ("flip", "truncate", "insert", "delete")
OUTCOMES = ("refused", "harmless", "silent")
BYTE_POSITIONS = 48   # enumerated: evenly spaced byte positions per file
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


def signature(artifact, h: int, d: int) -> dict:
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


def same(a: dict, b: dict) -> bool:
    tensors = len(a["decoded"]) == len(b["decoded"]) and all(torch.equal(x, y) for x, y in zip(a["decoded"], b["decoded"]))
    smooth = (a["smooth"] is None) == (b["smooth"] is None) and (a["smooth"] is None or torch.equal(a["smooth"], b["smooth"]))
    return tensors and smooth and all(a[k] == b[k] for k in ("policy", "cache", "model"))


@dataclass(frozen=True)
class Original:
    """One real artifact and what its mutations are judged against."""
    name: str
    raw_manifest: bytes
    raw_tensors: bytes
    spec: Any                      # the pipeline.model.ModelSpec it was calibrated for
    manifest: dict
    paths: list[tuple]             # every JSON path, in document order
    signature: dict
    strings: list[str]             # the manifest's own values: what a plausible same-type edit picks from
    ints: list[int]

    @classmethod
    def of(cls, name: str, raw_manifest: bytes, raw_tensors: bytes, spec) -> "Original":
        artifact = parse_artifact(raw_manifest, raw_tensors, spec)
        m = artifact.manifest
        return cls(name, raw_manifest, raw_tensors, spec, m, [p for p, _ in walk(m)],
                   signature(artifact, spec.n_kv_heads, spec.head_dim),
                   sorted({v for _, v in walk(m) if isinstance(v, str)}),
                   sorted({v for _, v in walk(m) if json_type(v) == "integer"}))


@dataclass(frozen=True)
class Mutation:
    mode: str
    what: str
    raw_manifest: bytes
    raw_tensors: bytes


# ---- the edits ---------------------------------------------------------------------------------------------

def mutate_bytes(raw: bytes, op: str, at: int, byte: int) -> tuple[bytes, str]:
    """op at position `at`; byte: the XOR mask of a flip (1..255) or the inserted byte (0..255)."""
    if op == "flip":
        return raw[:at] + bytes([raw[at] ^ byte]) + raw[at + 1:], f"flip@{at}^{byte}"
    if op == "truncate":
        return raw[:at], f"truncate@{at}"
    if op == "insert":
        return raw[:at] + bytes([byte]) + raw[at:], f"insert@{at}={byte}"
    return raw[:at] + raw[at + 1:], f"delete@{at}"


def same_type_options(v, strings: list[str], ints: list[int]) -> list:
    """Other values of v's JSON type, the plausible ones first (null has none)."""
    if isinstance(v, bool):
        options = [not v]
    elif isinstance(v, int):
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
    return [o for o in options if json.dumps(o) != json.dumps(v)]


def other_type_options(v) -> list:
    """Values of other JSON types, first the one equal to v by value (4 -> 4.0, 2.0 -> 2): what only a typed
    loader refuses."""
    alike = [float(v)] if json_type(v) == "integer" else \
        [int(v)] if json_type(v) == "number" and float(v).is_integer() and abs(v) < 1e15 else []
    return alike + [o for o in POOL if json_type(o) != json_type(v)]


def _at(manifest: dict, path: tuple):
    parent = manifest
    for k in path[:-1]:
        parent = parent[k]
    return parent, parent[path[-1]]


def edit_options(o: Original, path: tuple, edit: str) -> list:
    """What edit `edit` at `path` may write: values (same_type, other_type), (name, value) pairs (add), or the
    one deletion."""
    parent, old = _at(o.manifest, path)
    if edit == "delete":
        return [None]
    if edit == "same_type":
        return same_type_options(old, o.strings, o.ints)
    if edit == "other_type":
        return other_type_options(old)
    values = POOL + [old]
    target = old if isinstance(old, (dict, list)) else parent
    if isinstance(target, list):
        return [(None, v) for v in values]
    return [(name, v) for name in NAMES + [f"x_{path[-1]}"] for v in values]


def edit_json(o: Original, path: tuple, edit: str, option) -> tuple[dict, str]:
    """The manifest with one edit at path (an option from edit_options) -> (edited manifest, description)."""
    m = copy.deepcopy(o.manifest)
    parent, old = _at(m, path)
    key = path[-1]
    if edit == "delete":
        del parent[key]
    elif edit in ("same_type", "other_type"):
        parent[key] = copy.deepcopy(option)
    else:  # add: a member to the object at (or holding) the path, or an item to the array
        name, value = option
        target = old if isinstance(old, (dict, list)) else parent
        if isinstance(target, list):
            target.append(copy.deepcopy(value))
        else:
            target[name if name not in target else f"{name}_2"] = copy.deepcopy(value)
    return m, f"{edit} {'/'.join(map(str, path))}"


def json_mutation(o: Original, mode: str, path: tuple, edit: str, option) -> Mutation:
    edited, what = edit_json(o, path, edit, option)
    raw = mf.serialize_manifest(edited) if mode == "json_resigned" else json.dumps(edited, indent=1).encode()
    return Mutation(mode, what, raw, o.raw_tensors)


def byte_mutation(o: Original, mode: str, op: str, at: int, byte: int) -> Mutation:
    if mode == "manifest_bytes":
        raw, what = mutate_bytes(o.raw_manifest, op, at, byte)
        return Mutation(mode, what, raw, o.raw_tensors)
    raw, what = mutate_bytes(o.raw_tensors, op, at, byte)
    return Mutation(mode, what, o.raw_manifest, raw)


# ---- choosing the mutations ----------------------------------------------------------------------------------

def enumerated(o: Original) -> Iterator[Mutation]:
    """A fixed list, re-signed: every JSON path deleted, given the first other value of its type and a value of
    another type (the one equal by value where there is one: 4 -> 4.0, 1 -> true; else one rotating through the
    other types), and a member (rotating through names and values) added to every object and array; then one
    unsigned edit per top-level field, and BYTE_POSITIONS evenly spaced byte edits of each file."""
    for i, path in enumerate(o.paths):
        yield json_mutation(o, "json_resigned", path, "delete", None)
        same_type = edit_options(o, path, "same_type")
        if same_type:
            yield json_mutation(o, "json_resigned", path, "same_type", same_type[0])
        other = edit_options(o, path, "other_type")
        equal = [v for v in other if v == _at(o.manifest, path)[1]]   # 4 -> 4.0, 1 -> true: equal by value
        yield json_mutation(o, "json_resigned", path, "other_type", equal[0] if equal else other[i % len(other)])
        if isinstance(_at(o.manifest, path)[1], (dict, list)) or len(path) == 1:  # each object and array, the
            add = edit_options(o, path, "add")                                     # root through its members
            yield json_mutation(o, "json_resigned", path, "add", add[(7 * i) % len(add)])
    for section in sorted(o.manifest):
        path = next(p for p in o.paths if p[0] == section)
        yield json_mutation(o, "json_unsigned", path, "other_type", edit_options(o, path, "other_type")[0])
    for mode, raw in (("manifest_bytes", o.raw_manifest), ("tensor_bytes", o.raw_tensors)):
        for k in range(BYTE_POSITIONS):
            yield byte_mutation(o, mode, BYTE_OPS[k % len(BYTE_OPS)], k * len(raw) // BYTE_POSITIONS, 1 + 37 * k % 255)


def drawn(originals: list[Original], rng: random.Random, n: int) -> Iterator[tuple[Original, Mutation]]:
    """n mutations drawn at random: an artifact, a mode, then (JSON) a top-level field evenly, a path under it,
    an edit and one of its options (a retyped number: half the time the value equal to it, 4 -> 4.0), or (bytes)
    an operation and a position."""
    for _ in range(n):
        o = rng.choice(originals)
        mode = rng.choice(WEIGHTED_MODES)
        if mode in ("manifest_bytes", "tensor_bytes"):
            raw = o.raw_manifest if mode == "manifest_bytes" else o.raw_tensors
            op = rng.choice(BYTE_OPS)
            yield o, byte_mutation(o, mode, op, rng.randrange(len(raw)), rng.randint(1 if op == "flip" else 0, 255))
            continue
        section = rng.choice(sorted(o.manifest))
        path = rng.choice([p for p in o.paths if p[0] == section])
        edit = rng.choice(EDITS)
        options = edit_options(o, path, edit)
        if not options:  # null has no other value of its type
            edit, options = "other_type", edit_options(o, path, "other_type")
        equal = [v for v in options if v == _at(o.manifest, path)[1]] if edit == "other_type" else []
        option = equal[0] if equal and rng.random() < 0.5 else rng.choice(options)  # 4 -> 4.0 half the time
        yield o, json_mutation(o, mode, path, edit, option)


# ---- judging -------------------------------------------------------------------------------------------------

@dataclass
class Tally:
    counts: dict[str, Counter] = field(default_factory=lambda: {mode: Counter() for mode in MODES})
    refused_by: Counter = field(default_factory=Counter)
    silent: list[str] = field(default_factory=list)

    def judge(self, o: Original, m: Mutation) -> str:
        """Load the mutated files: refused (a ManifestError), harmless (what decodes is unchanged) or silent.
        Any other exception propagates: the loader crashed."""
        try:
            loaded = parse_artifact(m.raw_manifest, m.raw_tensors, o.spec)
        except mf.ManifestError as exc:
            outcome = "refused"
            self.refused_by[type(exc).__name__] += 1
        else:
            h, d = o.spec.n_kv_heads, o.spec.head_dim
            outcome = "harmless" if same(signature(loaded, h, d), o.signature) else "silent"
            if outcome == "silent":
                self.silent.append(f"{o.name} {m.mode}: {m.what}")
        self.counts[m.mode][outcome] += 1
        return outcome

    @property
    def total(self) -> Counter:
        return sum(self.counts.values(), Counter())

    def lines(self) -> list[str]:
        def line(c: Counter) -> str:
            return (f"tried {sum(c.values())}: refused {c['refused']}, harmless {c['harmless']}, "
                    f"silent and harmful {c['silent']}")
        out = [f"mutations {line(self.total)}"]
        out += [f"  {mode}: {line(self.counts[mode])}" for mode in MODES]
        out.append(f"  refused by: {dict(self.refused_by.most_common())}")
        out += [f"  SILENT {s}" for s in self.silent[:20]]
        return out

    def as_dict(self) -> dict:
        return {"total": {k: self.total[k] for k in OUTCOMES} | {"tried": sum(self.total.values())},
                "per_mode": {mode: {k: c[k] for k in OUTCOMES} for mode, c in self.counts.items()},
                "refused_by": dict(self.refused_by.most_common()), "silent": self.silent}


# ---- the artifacts -------------------------------------------------------------------------------------------

def build_originals(directory: Path, recipes: list[str], log=print) -> list[Original]:
    """The tiny model's artifact for each recipe, written by the pipeline as a user's run writes it."""
    from pipeline.app import run_pipeline
    from pipeline.config import DataConfig, EvalConfig, ModelConfig, RunConfig, load_recipe
    from pipeline.errors import GateError

    out = []
    for recipe in recipes:
        cfg = RunConfig(model=ModelConfig(name="tiny", source="tiny"),
                        data=DataConfig(n_samples=2, seq_len=64, eval_n_samples=1, eval_seq_len=64),
                        quant=load_recipe(recipe), eval=EvalConfig(recipes=["fp16"]), cache_dir=str(directory / "cache"))
        cfg.sensitivity.enabled = cfg.probes.enabled = cfg.tracking.enabled = cfg.export.vllm = False
        cfg.traces.reservoir_size = 64
        cfg.check.contexts, cfg.check.batches = [16], [1]
        try:
            result = run_pipeline(cfg, directory / recipe, log=lambda _m: None, show_progress=False)
        except GateError as exc:  # a random tiny model may cross the gate: the artifact records it
            result = exc.out
        art, spec = Path(result["summary"]["artifact_dir"]), result["model"].spec
        out.append(Original.of(recipe, (art / "manifest.json").read_bytes(), (art / mf.TENSOR_FILE).read_bytes(), spec))
        log(f"built {recipe}: {len(out[-1].paths)} JSON paths, {len(out[-1].raw_manifest)} + "
            f"{len(out[-1].raw_tensors)} bytes")
    return out


def campaign(originals: list[Original], examples: int, seed: int) -> Tally:
    tally = Tally()
    for o, m in drawn(originals, random.Random(seed), examples):
        tally.judge(o, m)
    return tally


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.manifest_mutations", description=__doc__.split("\n\n")[0])
    ap.add_argument("--examples", type=int, default=5000, help="mutations to draw (default 5000)")
    ap.add_argument("--seed", type=int, default=0, help="random.Random seed (default 0)")
    ap.add_argument("--json", default=None, help="write the counts to this JSON file")
    ap.add_argument("--recipes", nargs="+", default=list(RECIPES), help=f"default: {' '.join(RECIPES)}")
    ap.add_argument("--workdir", default=None, help="where the pipeline runs (default: a temporary folder)")
    args = ap.parse_args(argv)
    if args.examples < 1:
        ap.error(f"--examples must be >= 1, got {args.examples}")
    from bench.common import write_json

    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kvcalib-mutations-") as tmp:
        originals = build_originals(Path(args.workdir or tmp), args.recipes)
    built = time.perf_counter()
    tally = campaign(originals, args.examples, args.seed)
    done = time.perf_counter()
    print("\n".join(tally.lines()))
    print(f"seed {args.seed}; artifacts built in {built - start:.1f} s, {args.examples} mutations judged in "
          f"{done - built:.1f} s")
    write_json(args.json, {"examples": args.examples, "seed": args.seed, "recipes": args.recipes, **tally.as_dict(),
                           "build_s": round(built - start, 2), "campaign_s": round(done - built, 2)})
    if tally.silent:
        print(f"FAILED: {len(tally.silent)} mutations were accepted silently and change what decodes", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
