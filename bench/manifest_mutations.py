"""Mutation campaign against an artifact's consumers: the strict loader (exporters/artifact.py parse_artifact), the
library path without the model check (exporters.native.load_artifact(DIR) then serving.cache.ArtifactCache), and
`pipeline show DIR` (issue 51: an artifact comes from a stranger, and its checksums are not a signature).

Property: every mutation of a real artifact is refused with a ManifestError subclass (an InputError where the serving
cache refuses), or is provably harmless -- the loaded policy decodes a fixed K/V tensor bit-identically under every
layer's key and value policy, and the sequence-level fields (sinks, residual, RoPE stage and parameters, smoothing,
prefix) are unchanged. Any other exception is a crash, a call still running after DEADLINE_S seconds a hang, and
`pipeline show DIR` of the mutated folder must exit 0 or 2 (5 says "a bug"; any code but 0 or 2 counts as exit5).

Modes:
- manifest_bytes / tensor_bytes: byte flips, truncation, insertion or deletion in either file;
- json_unsigned: JSON edits (delete a member, another value of the same type, a value of another type, an added
  member) written without a new digest; json_resigned: the same edits re-signed, as a tool that recomputes the
  digest would write them, so that the schema, the cross-checks and the binding to the tensor file refuse;
- tensor_values_resigned: one calibrated float tensor poisoned (NaN, +inf or -inf in any of them; a negative range;
  lower > upper in one channel; a subnormal range; an fp8 scale of 0, subnormal, negative or above
  the format's range; a smoothing factor of 0, subnormal or below; prefix K/V beyond float16), re-signed as a tool would (the tensor's sha256, the tensor file's sha256 and
  the manifest digest; the header's bound fields unchanged). Refused, or silent: a poisoned value changes decoding.
  A re-signed edit to another VALID value (a range x 0.5, range = 0 on a channel, a shifted codebook) is another
  calibration that no loader can tell from a real one; `pipeline check`'s quality canary is what sees it
  (runtime_check/canary.py, tested there), so such edits are not drawn here;
- shape_lies_resigned: a consistent artifact for another model -- model n_kv_heads, head_dim, n_layers, n_q_heads
  or RoPE theta changed, every tensor cut or padded to the new shapes, re-hashed, the header's bound fields rebuilt
  (exporters.manifest.bound_metadata), re-signed. load_artifact(DIR) without a model takes it as well formed; then
  ArtifactCache(policy, the tiny model) must refuse it (InputError) before any kernel runs, and the strict path with
  the model (parse_artifact(..., spec)) must refuse it (ModelMismatchError). Accepted on either path = silent;
- files: the artifact folder with one file replaced by a FIFO, a symbolic link to /dev/zero, a symbolic link to a copy
  of the file outside the folder, a directory, a sparse file of SPARSE_BYTES or an empty file; and for its vLLM
  checkpoint folder (exporters/compressed_tensors.py, the fp8 recipe: the only one of RECIPES vLLM serves) the same
  for any of its files, and a kvcalib/checkpoint.json listing an absolute path, a `../` path or a huge sparse file
  (each with its right size and, but for the sparse file, its right sha256). load_artifact(DIR, spec) must refuse.

Every mutation is written as a folder and shown through `pipeline show DIR` (pipeline.cli.main, in this process);
each judged call runs under a SIGALRM deadline of DEADLINE_S seconds.

Two ways of choosing the mutations share everything else here:
- `enumerated`: a fixed list that edits every JSON path of an artifact with each kind of edit (and a fixed set
  of byte positions, poisons, shape lies and file replacements); tests/exporters/test_manifest_mutations.py runs it,
  so CI never depends on chance;
- `drawn`: a seeded random campaign, this module's command line:

    python -m bench.manifest_mutations --examples N [--seed S] [--json PATH] [--recipes NAME ...] [--modes MODE ...]

  builds the tiny model's artifacts with the pipeline (embedded text, evaluation, drift gate and runtime check
  on, so every informative field is filled as a run fills it) and the fp8 one's vLLM checkpoint, draws N mutations
  with random.Random(S), prints the counts (tried, refused, harmless, silent, crashes, hangs, exit5; per mode, and
  per refusal class) and exits 1 if any mutation was accepted silently, crashed, hung or made `show` exit 5.
"""
from __future__ import annotations

import argparse
import copy
import hashlib
import io
import json
import math
import os
import random
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager, redirect_stderr, redirect_stdout
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from exporters import compressed_tensors as ct
from exporters import manifest as mf
from exporters.artifact import MANIFEST_FILE, parse_artifact, tensor_file_metadata
from exporters.checksums import sha256_bytes
from exporters.codec import FP8, decode, encode
from exporters.errors import InputError

RECIPES = ("kvquant-3b-1pct+smooth+prefix", "kivi-2", "fp8-e4m3", "kvquant-2b+sink16+recent32+rotclipv")
MODES = ("manifest_bytes", "tensor_bytes", "json_unsigned", "json_resigned", "tensor_values_resigned",
         "shape_lies_resigned", "files")
WEIGHTED_MODES = MODES + ("json_resigned",) * 2  # a third of the draws: the edits only cross-checks can refuse
EDITS = ("delete", "same_type", "other_type", "add")
BYTE_OPS = ("flip", "truncate", "insert", "delete")
# one per mutation, the worst of its judged paths (later is worse); FINDINGS fail the campaign, exit5 among them:
# `pipeline show` exiting with neither 0 nor 2, counted beside the outcome
OUTCOMES = ("refused", "harmless", "silent", "crashes", "hangs")
FINDINGS = ("silent", "crashes", "hangs", "exit5")
BYTE_POSITIONS = 48   # enumerated: evenly spaced byte positions per file
DEADLINE_S = 10       # per judged call; every refusal takes milliseconds
# values of every JSON type, and member names a schema-aware edit would add
POOL = [None, True, False, 0, 1, -1, 3, 0.0, 0.5, -2.5, 1e30, "", "x", "none", "1", [], [0], [1.5, 2.5], {}, {"a": 1}]
NAMES = ["x", "expected_fraction", "fp8_dtype", "zero_point", "error", "ids", "ppl_seeds", "thresholds", "gate",
         "manifest_digest", "__metadata__", "tensor"]
# tensor_values_resigned: NONFINITE in any float tensor, and each tensor role's own out-of-range values
NONFINITE = ("nan", "+inf", "-inf")
ROLE_POISONS = {"range": ("negative", "subnormal"), "lower": ("above_upper",),
                "upper": ("below_lower",), "fp8_scale": ("zero", "negative", "above_max", "subnormal"),
                "smooth": ("zero", "negative", "subnormal"),
                "prefix.k": ("beyond_fp16",), "prefix.v": ("beyond_fp16",),
                "rotation_signs": ("zero", "half")}   # signs are exactly +1 or -1
FP16_MAX = float(torch.finfo(torch.float16).max)
# shape_lies_resigned: the model fields changed; per tensor role, the dimensions holding (layers, kv heads, channels)
SHAPE_FIELDS = ("n_kv_heads", "head_dim", "n_layers", "n_q_heads", "rope_theta")
ROLE_DIMS = {"zero": (None, 0, 1), "range": (None, 0, 1), "lower": (None, 0, 1), "upper": (None, 0, 1),
             "fp8_scale": (None, 0, None), "smooth": (0, 1, 2), "prefix.k": (0, 1, 3), "prefix.v": (0, 1, 3),
             "rotation_signs": (None, None, 0)}   # [b]: b = head_dim & -head_dim, the rotation's block
# files: what replaces a file of the folder, and (a vLLM checkpoint's) record entries leaving it or naming a huge file
FILE_KINDS = ("fifo", "dev_zero", "outside_link", "directory", "sparse", "empty")
RECORD_KINDS = ("record_absolute", "record_dotdot", "record_sparse")
NATIVE_FILES = (MANIFEST_FILE, mf.TENSOR_FILE)
RECORD = f"{ct.ARTIFACT_DIR}/{ct.RECORD_FILE}"
SPARSE_BYTES = 50 << 30   # a sparse file's apparent size: 50 GB in no disk


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
    """One real artifact and what its mutations are judged against; `model`: the torch model it was calibrated on
    (the serving cache's check), `checkpoint`: its vLLM checkpoint folder, if vLLM serves its recipe."""
    name: str
    raw_manifest: bytes
    raw_tensors: bytes
    spec: Any                      # the pipeline.model.ModelSpec it was calibrated for
    manifest: dict
    paths: list[tuple]             # every JSON path, in document order
    signature: dict
    strings: list[str]             # the manifest's own values: what a plausible same-type edit picks from
    ints: list[int]
    float_tensors: tuple[str, ...] = ()     # the tensors a poison can go into
    model: Any = None
    checkpoint: Path | None = None
    checkpoint_files: tuple[str, ...] = ()  # every file of the checkpoint folder (its record's and the record)

    @classmethod
    def of(cls, name: str, raw_manifest: bytes, raw_tensors: bytes, spec, model=None,
           checkpoint: Path | None = None) -> "Original":
        artifact = parse_artifact(raw_manifest, raw_tensors, spec)
        m = artifact.manifest
        files = ()
        if checkpoint is not None:
            files = tuple(sorted(json.loads((Path(checkpoint) / RECORD).read_text())["files"])) + (RECORD,)
        return cls(name, raw_manifest, raw_tensors, spec, m, [p for p, _ in walk(m)],
                   signature(artifact, spec.n_kv_heads, spec.head_dim),
                   sorted({v for _, v in walk(m) if isinstance(v, str)}),
                   sorted({v for _, v in walk(m) if json_type(v) == "integer"}),
                   tuple(sorted(k for k, t in artifact.tensors.items() if t.is_floating_point())),
                   model, None if checkpoint is None else Path(checkpoint), files)


@dataclass(frozen=True)
class FileEdit:
    """One file of a folder replaced (target: its path in the folder; kind: FILE_KINDS), or one entry added to a
    checkpoint's record (kind: RECORD_KINDS). layout: "native" (the artifact folder) or "checkpoint"."""
    layout: str
    target: str
    kind: str


@dataclass(frozen=True)
class Mutation:
    mode: str
    what: str
    raw_manifest: bytes
    raw_tensors: bytes
    edit: FileEdit | None = None   # files: the folder written from the original, then this edit made


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


def resign(manifest: dict, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> tuple[bytes, bytes]:
    """(manifest.json, tensors.safetensors) as a tool that keeps every checksum valid writes them (docs/manifest.md):
    each tensor listed with its dtype, shape and sha256, the tensor file with `metadata` as its header's
    __metadata__, the file's sha256, the manifest signed. `manifest` is edited in place."""
    manifest["tensors"] = {name: {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                                  "sha256": sha256_bytes(t)} for name, t in sorted(tensors.items())}
    raw_tensors = save_safetensors(tensors, metadata=metadata)
    manifest["tensor_file"]["sha256"] = hashlib.sha256(raw_tensors).hexdigest()
    return mf.serialize_manifest(manifest), raw_tensors


def tensor_role(name: str) -> str:
    """layers.3.key.range -> range; smooth, prefix.k, prefix.v, prefix.ids as they are."""
    return name.rsplit(".", 1)[-1] if name.startswith("layers.") else name


def poisons(name: str) -> tuple[str, ...]:
    return NONFINITE + ROLE_POISONS.get(tensor_role(name), ())


def poison_value(o: Original, tensors: dict[str, torch.Tensor], name: str, kind: str, at: int) -> float:
    """The value poison `kind` writes at flat index `at` of tensor `name` (its neighbours' values as they are)."""
    x = float(tensors[name].reshape(-1)[at])
    if kind in NONFINITE:
        return {"nan": math.nan, "+inf": math.inf, "-inf": -math.inf}[kind]
    if kind == "negative":
        return -(abs(x) + 0.5)
    if kind == "zero":
        return 0.0
    if kind == "half":
        return 0.5
    if kind == "subnormal":   # below float32's smallest normal: no scale or factor means anything there
        return 1e-40
    if kind == "above_max":   # twice the largest scale whose decoded values fit float16
        _, i, side, _ = name.split(".")
        return 2 * FP16_MAX / FP8[o.manifest["layers"][int(i)][side]["fp8_dtype"]][1]
    if kind in ("above_upper", "below_lower"):
        other = name.rsplit(".", 1)[0] + (".upper" if kind == "above_upper" else ".lower")
        y = float(tensors[other].reshape(-1)[at])
        return y + 1.0 if kind == "above_upper" else y - 1.0
    return math.copysign(2 * FP16_MAX, x or 1.0)   # beyond_fp16


def value_mutation(o: Original, name: str, kind: str, at: int) -> Mutation:
    """One value of tensor `name` poisoned (`at` taken modulo its size), re-signed with the header's bound fields
    unchanged: only the values check (exporters.manifest.check_values) can refuse it."""
    tensors = load_safetensors(o.raw_tensors)
    t = tensors[name].clone()
    at %= t.numel()
    t.reshape(-1)[at] = poison_value(o, tensors, name, kind, at)
    tensors[name] = t
    raw_manifest, raw_tensors = resign(copy.deepcopy(o.manifest), tensors, tensor_file_metadata(o.raw_tensors))
    return Mutation("tensor_values_resigned", f"{kind} in {name}[{at}]", raw_manifest, raw_tensors)


def shape_options(model: dict, name: str) -> list:
    """Other values of a model field, for an artifact of another model: heads keep grouped-query attention
    (n_q_heads a multiple of n_kv_heads), head_dim stays even (RoPE pairs channels)."""
    h, d, n, q, theta = (model["n_kv_heads"], model["head_dim"], model["n_layers"], model["n_q_heads"],
                         model["rope"]["theta"])
    current = theta if name == "rope_theta" else model[name]
    options = {"n_kv_heads": [1, 2 * h, h + 1], "head_dim": [d // 2 + d // 2 % 2, d + 2, 2 * d],
               "n_layers": [n - 1, n + 1, 2 * n], "n_q_heads": [2 * q, q + h, h],
               "rope_theta": [theta * 2, theta / 2, theta + 1]}[name]
    return [v for i, v in enumerate(options) if v >= 1 and v != current and v not in options[:i]]


def _resized(t: torch.Tensor, dim: int, n: int) -> torch.Tensor:
    """t cut or padded to n along dim; padding repeats the last slice, so valid values stay valid."""
    size = t.shape[dim]
    if n <= size:
        return t.narrow(dim, 0, n).contiguous()
    return torch.cat([t] + [t.narrow(dim, size - 1, 1)] * (n - size), dim).contiguous()


def _fitted(name: str, t: torch.Tensor, axis: int, n: int) -> torch.Tensor:
    """Tensor `name` resized to n along its dimension `axis` (0 layers, 1 kv heads, 2 channels), if it has one
    (rotation signs to the block of n channels)."""
    dims = ROLE_DIMS.get(tensor_role(name), (None, None, None))
    if tensor_role(name) == "rotation_signs":
        n = n & -n
    return t if t.dim() == 0 or dims[axis] is None else _resized(t, dims[axis], n)


def _relayered(m: dict, tensors: dict[str, torch.Tensor], n: int) -> dict[str, torch.Tensor]:
    """The manifest's layers cut to n, or padded by repeating the last one (its tensors copied under the new
    layer's names); the per-layer tensors (smooth, prefix K/V) and layer types follow."""
    old = m["layers"]
    source = [min(i, len(old) - 1) for i in range(n)]
    out = {k: v for k, v in tensors.items() if not k.startswith("layers.")}
    m["layers"] = []
    for i, j in enumerate(source):
        layer = copy.deepcopy(old[j])
        layer["index"] = i
        for side in ("key", "value"):
            refs = layer[side]["tensors"]
            for role, ref in refs.items():
                refs[role] = f"layers.{i}.{side}.{role}"
                out[refs[role]] = tensors[ref].clone()
        m["layers"].append(layer)
    model = m["model"]
    model["n_layers"] = n
    if model.get("attention"):
        model["attention"]["layer_types"] = [model["attention"]["layer_types"][j] for j in source]
    return {k: _fitted(k, t, 0, n) for k, t in out.items()}


def shape_mutation(o: Original, name: str, value) -> Mutation:
    """An artifact consistent in itself for a model whose field `name` is `value` (SHAPE_FIELDS): every tensor cut
    or padded to its shapes, re-hashed, the header's bound fields rebuilt, re-signed."""
    m = copy.deepcopy(o.manifest)
    tensors = load_safetensors(o.raw_tensors)
    model = m["model"]
    if name == "rope_theta":
        model["rope"]["theta"] = value
    elif name == "n_q_heads":
        model["n_q_heads"] = value
    elif name == "n_layers":
        tensors = _relayered(m, tensors, value)
    else:
        if name == "n_kv_heads":   # the same query heads per kv head
            model["n_q_heads"] = model["n_q_heads"] // model["n_kv_heads"] * value
        model[name] = value
        axis = 1 if name == "n_kv_heads" else 2
        tensors = {k: _fitted(k, t, axis, value) for k, t in tensors.items()}
    raw_manifest, raw_tensors = resign(m, tensors, mf.bound_metadata(m))
    return Mutation("shape_lies_resigned", f"model {name} {value!r}", raw_manifest, raw_tensors)


def file_mutation(o: Original, layout: str, target: str, kind: str) -> Mutation:
    what = f"{layout} {target}: {kind}" if kind in FILE_KINDS else f"{layout} {RECORD}: {kind}"
    return Mutation("files", what, o.raw_manifest, o.raw_tensors, FileEdit(layout, target, kind))


# ---- choosing the mutations ----------------------------------------------------------------------------------

def enumerated(o: Original) -> Iterator[Mutation]:
    """A fixed list, re-signed: every JSON path deleted, given the first other value of its type and a value of
    another type (the one equal by value where there is one: 4 -> 4.0, 1 -> true; else one rotating through the
    other types), and a member (rotating through names and values) added to every object and array; then one
    unsigned edit per top-level field, and BYTE_POSITIONS evenly spaced byte edits of each file; NaN in every
    float tensor, +inf and -inf in the first, each role's own poison in the first tensor of that role; every
    shape lie of shape_options; each of the two files replaced by each FILE_KINDS, and (with a checkpoint) each
    of its files so, and each RECORD_KINDS."""
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
    yield from (value_mutation(o, name, "nan", k) for k, name in enumerate(o.float_tensors))
    yield from (value_mutation(o, o.float_tensors[0], kind, 1) for kind in NONFINITE[1:] if o.float_tensors)
    first = {}
    for name in o.float_tensors:
        first.setdefault(tensor_role(name), name)
    yield from (value_mutation(o, name, kind, 7) for role, name in first.items() for kind in ROLE_POISONS.get(role, ()))
    if o.model is not None:
        yield from (shape_mutation(o, name, value) for name in SHAPE_FIELDS
                    for value in shape_options(o.manifest["model"], name))
    yield from (file_mutation(o, "native", target, kind) for target in NATIVE_FILES for kind in FILE_KINDS)
    yield from (file_mutation(o, "checkpoint", target, kind) for target in o.checkpoint_files for kind in FILE_KINDS)
    yield from (file_mutation(o, "checkpoint", RECORD, kind) for kind in RECORD_KINDS if o.checkpoint)


def supports(o: Original, mode: str) -> bool:
    """Whether mutations of `mode` can be made of o: poisons need a float tensor, shape lies a model to serve."""
    return {"tensor_values_resigned": bool(o.float_tensors), "shape_lies_resigned": o.model is not None}.get(mode, True)


def drawn(originals: list[Original], rng: random.Random, n: int, modes: tuple[str, ...] = MODES
          ) -> Iterator[tuple[Original, Mutation]]:
    """n mutations drawn at random: an artifact and a mode among `modes` (WEIGHTED_MODES; another artifact where
    that one has nothing for the mode), then (JSON) a top-level field evenly, a path under it, an edit and one of
    its options (a retyped number: half the time the value equal to it, 4 -> 4.0); (bytes) an operation and a
    position; (values) a float tensor, one of its poisons and a position; (shape lies) a field and another value;
    (files) half the time the vLLM checkpoint folder, where there is one, then a kind and a file."""
    modes = [mode for mode in WEIGHTED_MODES if mode in modes and any(supports(o, mode) for o in originals)]
    if not modes:
        raise ValueError("none of the modes can be drawn: poisons need an artifact with a float tensor, shape lies one "
                         "with its model")
    checkpoints = [o for o in originals if o.checkpoint is not None]
    for _ in range(n):
        o = rng.choice(originals)
        mode = rng.choice(modes)
        if not supports(o, mode):
            o = rng.choice([x for x in originals if supports(x, mode)])
        if mode in ("manifest_bytes", "tensor_bytes"):
            raw = o.raw_manifest if mode == "manifest_bytes" else o.raw_tensors
            op = rng.choice(BYTE_OPS)
            yield o, byte_mutation(o, mode, op, rng.randrange(len(raw)), rng.randint(1 if op == "flip" else 0, 255))
            continue
        if mode == "tensor_values_resigned":
            name = rng.choice(o.float_tensors)
            yield o, value_mutation(o, name, rng.choice(poisons(name)), rng.randrange(1 << 30))
            continue
        if mode == "shape_lies_resigned":
            name = rng.choice(SHAPE_FIELDS)
            yield o, shape_mutation(o, name, rng.choice(shape_options(o.manifest["model"], name)))
            continue
        if mode == "files":
            if checkpoints and rng.random() < 0.5:
                o = rng.choice(checkpoints)
                kind = rng.choice(FILE_KINDS + RECORD_KINDS)
                target = rng.choice(o.checkpoint_files) if kind in FILE_KINDS else RECORD
                yield o, file_mutation(o, "checkpoint", target, kind)
            else:
                yield o, file_mutation(o, "native", rng.choice(NATIVE_FILES), rng.choice(FILE_KINDS))
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


# ---- the mutated folder ----------------------------------------------------------------------------------------

def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:   # another file system
        shutil.copy2(src, dst)


def link_tree(src: Path, dst: Path) -> None:
    """A copy of a checkpoint folder whose files are hard links to the original's (megabytes of weights per
    mutation otherwise): every edit unlinks a file before it writes one."""
    shutil.copytree(src, dst, copy_function=_link_or_copy)


def _replace(path: Path, kind: str, outside: Path) -> None:
    """The file at `path` replaced by `kind` (FILE_KINDS); `outside`: a folder beside the artifact's."""
    content = path.read_bytes() if kind == "outside_link" else None
    path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "dev_zero":
        os.symlink("/dev/zero", path)
    elif kind == "outside_link":   # the same bytes outside the folder: followed, it would verify
        copied = outside / f"outside-{path.name}"
        copied.write_bytes(content)
        os.symlink(copied.resolve(), path)
    elif kind == "directory":
        path.mkdir()
    elif kind == "sparse":
        with open(path, "wb") as f:
            f.truncate(SPARSE_BYTES)
    else:
        path.write_bytes(b"")


def _add_record_entry(folder: Path, kind: str, outside: Path) -> None:
    """A checkpoint's record given one more entry, with its file's size and (but for the sparse file, whose hash
    would take minutes) its sha256: an absolute path outside the folder, a `../` path, or a huge sparse file inside."""
    record = folder / RECORD
    data = json.loads(record.read_text())
    if kind == "record_sparse":
        path, rel, digest = folder / "huge.bin", "huge.bin", "0" * 64
        with open(path, "wb") as f:
            f.truncate(SPARSE_BYTES)
    else:
        path = outside / "outside.txt"
        path.write_text("a file beside the checkpoint folder\n")
        rel = str(path.resolve()) if kind == "record_absolute" else f"../{path.name}"
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
    data["files"][rel] = digest
    data.setdefault("sizes", {})[rel] = path.stat().st_size
    record.unlink()   # a hard link to the template
    record.write_text(json.dumps(data))


def write_folder(o: Original, m: Mutation, folder: Path) -> None:
    """The mutation as a folder a user would be handed: the artifact's two files (mutated or not), or a copy of its
    vLLM checkpoint, then the file edit. Everything the edit puts outside the folder goes beside it."""
    if m.edit is not None and m.edit.layout == "checkpoint":
        link_tree(o.checkpoint, folder)
    else:
        folder.mkdir(exist_ok=True)
        (folder / MANIFEST_FILE).write_bytes(m.raw_manifest)
        (folder / mf.TENSOR_FILE).write_bytes(m.raw_tensors)
    if m.edit is not None:
        if m.edit.kind in FILE_KINDS:
            _replace(folder / m.edit.target, m.edit.kind, folder.parent)
        else:
            _add_record_entry(folder, m.edit.kind, folder.parent)


# ---- judging -------------------------------------------------------------------------------------------------

class Hung(BaseException):
    """A judged call still running at its deadline. A BaseException, so that no `except Exception` of the code
    judged (the command line's internal-error handler among them) turns it into something else."""


@contextmanager
def deadline(seconds: int | None = None):
    """Raise Hung in the judged call after `seconds` (default DEADLINE_S; SIGALRM interrupts a blocked open() of a
    FIFO or a hashing loop). Only the main thread receives signals: elsewhere, no deadline."""
    seconds = DEADLINE_S if seconds is None else seconds
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def ring(_signum, _frame):
        raise Hung(f"still running after {seconds} s")

    old = signal.signal(signal.SIGALRM, ring)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def _crash_text(exc: BaseException) -> str:
    frame = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ else None
    where = f" at {Path(frame.filename).name}:{frame.lineno} ({frame.name})" if frame else ""
    return f"{type(exc).__name__}: {str(exc)[:200]}{where}"


def attempt(call: Callable[[], Any], refusals: tuple[type[BaseException], ...] = (mf.ManifestError,)
            ) -> tuple[str, Any]:
    """call() under the deadline -> ("accepted", its value), ("refused", the refusal's class name), ("crashes", the
    exception and where it was raised) or ("hangs", ...)."""
    try:
        with deadline():
            return "accepted", call()
    except Hung as exc:
        return "hangs", str(exc)
    except refusals as exc:
        return "refused", type(exc).__name__
    except Exception as exc:  # noqa: BLE001 -- anything but a refusal is a crash of the code judged
        return "crashes", _crash_text(exc)


Judged = tuple[str, str, Any]   # one judged path: (label, outcome, detail)


def judge_decoding(o: Original, m: Mutation, _folder: Path) -> list[Judged]:
    """The strict loader with the model: refused, or accepted and harmless (what decodes is unchanged) or silent."""
    h, d = o.spec.n_kv_heads, o.spec.head_dim
    outcome, value = attempt(lambda: same(signature(parse_artifact(m.raw_manifest, m.raw_tensors, o.spec), h, d),
                                          o.signature))
    if outcome == "accepted":
        return [("", "harmless", None) if value else ("", "silent", "accepted, and decodes differently")]
    return [("", outcome, value)]


def judge_refused(o: Original, m: Mutation, _folder: Path) -> list[Judged]:
    """The strict loader with the model must refuse: a poisoned tensor changes decoding, whatever else holds."""
    outcome, value = attempt(lambda: parse_artifact(m.raw_manifest, m.raw_tensors, o.spec))
    return [("", "silent", "accepted") if outcome == "accepted" else ("", outcome, value)]


def judge_served(o: Original, m: Mutation, folder: Path) -> list[Judged]:
    """An artifact for another model: the library path without the model check (load_artifact(DIR), then
    ArtifactCache with the tiny model) must refuse it before any kernel runs (the cache's constructor runs none),
    and so must the strict path with the model (parse_artifact(..., spec): ModelMismatchError)."""
    from exporters.native import load_artifact
    from serving.cache import ArtifactCache

    out: list[Judged] = []
    outcome, art = attempt(lambda: load_artifact(folder))
    if outcome == "accepted":
        outcome, value = attempt(lambda: ArtifactCache(art.policy, o.model), refusals=(InputError,))
        out.append(("ArtifactCache", "silent", "served for the model given") if outcome == "accepted" else
                   ("ArtifactCache", outcome, value))
    else:
        out.append(("load_artifact", outcome, art))
    outcome, value = attempt(lambda: parse_artifact(m.raw_manifest, m.raw_tensors, o.spec))
    out.append(("strict", "silent", "accepted for the model given") if outcome == "accepted" else
               ("strict", outcome, value))
    return out


def judge_folder(o: Original, _m: Mutation, folder: Path) -> list[Judged]:
    """The folder through the loader a user calls (load_artifact(DIR, spec)): every file replacement is refused."""
    from exporters.native import load_artifact

    outcome, value = attempt(lambda: load_artifact(folder, o.spec))
    return [("", "silent", "accepted") if outcome == "accepted" else ("", outcome, value)]


JUDGES: dict[str, Callable[[Original, Mutation, Path], list[Judged]]] = {
    "manifest_bytes": judge_decoding, "tensor_bytes": judge_decoding, "json_unsigned": judge_decoding,
    "json_resigned": judge_decoding, "tensor_values_resigned": judge_refused, "shape_lies_resigned": judge_served,
    "files": judge_folder}


def show_exit(folder: Path) -> tuple[Any, str]:
    """`pipeline show DIR` run in this process (pipeline.cli.main, its output captured) -> (exit status, the last
    line it wrote to stderr)."""
    from pipeline.cli import main as cli

    err = io.StringIO()
    with redirect_stdout(io.StringIO()), redirect_stderr(err):
        try:
            cli(["show", str(folder)])
            code: Any = "returned without exiting"
        except SystemExit as exc:
            code = 0 if exc.code is None else exc.code
    lines = err.getvalue().strip().splitlines()
    return code, lines[-1][:300] if lines else ""


@dataclass
class Tally:
    counts: dict[str, Counter] = field(default_factory=lambda: {mode: Counter() for mode in MODES})
    refused_by: Counter = field(default_factory=Counter)
    findings: dict[str, list[str]] = field(default_factory=lambda: {k: [] for k in FINDINGS})

    def judge(self, o: Original, m: Mutation, work: Path) -> str:
        """Write the mutation as a folder under `work` (empty, or for a mutation without a file edit, holding only
        the folder a previous such mutation wrote), judge it by its mode (JUDGES) and through
        `pipeline show`, and count it: its outcome (the worst of its paths: refused, harmless, silent, crashes,
        hangs) and whether show exited with neither 0 nor 2 (exit5). Returns the outcome."""
        folder = work / "artifact"
        write_folder(o, m, folder)
        paths = JUDGES[m.mode](o, m, folder)
        shown, value = attempt(lambda: show_exit(folder), refusals=())
        if shown == "hangs":
            paths.append(("pipeline show", "hangs", value))
        elif shown == "crashes" or value[0] not in (0, 2):
            detail = value if shown == "crashes" else f"exit {value[0]}: {value[1]}"
            self.findings["exit5"].append(f"{o.name} {m.mode}: {m.what} [pipeline show]: {detail}")
            self.counts[m.mode]["exit5"] += 1
        for label, outcome, detail in paths:
            if outcome == "refused":
                self.refused_by[f"{label}: {detail}" if label else detail] += 1
            elif outcome in FINDINGS:
                self.findings[outcome].append(f"{o.name} {m.mode}: {m.what}" + (f" [{label}]" if label else "") +
                                              (f": {detail}" if detail else ""))
        outcome = max((p[1] for p in paths), key=OUTCOMES.index)
        self.counts[m.mode][outcome] += 1
        return outcome

    @property
    def total(self) -> Counter:
        return sum(self.counts.values(), Counter())

    @property
    def failures(self) -> int:
        return sum(self.total[k] for k in FINDINGS)

    @staticmethod
    def row(c: Counter) -> dict[str, int]:
        return {"tried": sum(c[k] for k in OUTCOMES), **{k: c[k] for k in OUTCOMES}, "exit5": c["exit5"]}

    def lines(self) -> list[str]:
        def line(c: Counter) -> str:
            row = self.row(c)
            return f"tried {row.pop('tried')}: " + ", ".join(f"{k} {v}" for k, v in row.items())
        out = [f"mutations {line(self.total)}"]
        out += [f"  {mode}: {line(self.counts[mode])}" for mode in MODES]
        out.append(f"  refused by: {dict(self.refused_by.most_common())}")
        for kind in FINDINGS:
            out += [f"  {kind.upper()} {s}" for s in self.findings[kind][:20]]
        return out

    def as_dict(self) -> dict:
        return {"total": self.row(self.total), "per_mode": {mode: self.row(c) for mode, c in self.counts.items()},
                "refused_by": dict(self.refused_by.most_common()), "findings": self.findings}


# ---- the artifacts -------------------------------------------------------------------------------------------

def vllm_checkpoint(artifact_dir: Path, lm, directory: Path) -> Path | None:
    """The artifact's vLLM checkpoint folder written at `directory` (pipeline.export.write_vllm_checkpoint, the
    model's weights saved), or None when vLLM serves no such recipe."""
    from pipeline.export import write_vllm_checkpoint

    try:
        return write_vllm_checkpoint(directory, artifact_dir, lm)
    except ct.CheckpointError:
        return None


def build_originals(directory: Path, recipes: list[str], log=print) -> list[Original]:
    """The tiny model's artifact for each recipe, written by the pipeline as a user's run writes it, and its vLLM
    checkpoint where vLLM serves the recipe."""
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
        art, lm = Path(result["summary"]["artifact_dir"]), result["model"]
        checkpoint = vllm_checkpoint(art, lm, directory / f"{recipe}-vllm")
        out.append(Original.of(recipe, (art / MANIFEST_FILE).read_bytes(), (art / mf.TENSOR_FILE).read_bytes(),
                               lm.spec, lm.model, checkpoint))
        log(f"built {recipe}: {len(out[-1].paths)} JSON paths, {len(out[-1].raw_manifest)} + "
            f"{len(out[-1].raw_tensors)} bytes" + (", and its vLLM checkpoint" if checkpoint else ""))
    return out


def judge_all(tally: Tally, pairs: Iterator[tuple[Original, Mutation]], work: Path) -> Tally:
    """Judge each (original, mutation) under `work`: a file edit in a fresh folder, deleted after; the others in
    one folder whose two files each mutation overwrites (a folder deleted per mutation costs more than the
    mutation's judging on some file systems)."""
    plain = work / "plain"
    plain.mkdir(parents=True, exist_ok=True)
    for k, (o, m) in enumerate(pairs):
        if m.edit is None:
            tally.judge(o, m, plain)
            continue
        here = work / f"m{k}"
        here.mkdir()
        try:
            tally.judge(o, m, here)
        finally:
            shutil.rmtree(here, ignore_errors=True)
    return tally


def campaign(originals: list[Original], examples: int, seed: int, work: Path, modes: tuple[str, ...] = MODES
             ) -> Tally:
    return judge_all(Tally(), drawn(originals, random.Random(seed), examples, modes), work)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.manifest_mutations", description=__doc__.split("\n\n")[0])
    ap.add_argument("--examples", type=int, default=5000, help="mutations to draw (default 5000)")
    ap.add_argument("--seed", type=int, default=0, help="random.Random seed (default 0)")
    ap.add_argument("--json", default=None, help="write the counts to this JSON file")
    ap.add_argument("--recipes", nargs="+", default=list(RECIPES), help=f"default: {' '.join(RECIPES)}")
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES, metavar="MODE",
                    help=f"draw only these modes (default: all of {' '.join(MODES)})")
    ap.add_argument("--workdir", default=None, help="where the pipeline runs (default: a temporary folder)")
    args = ap.parse_args(argv)
    if args.examples < 1:
        ap.error(f"--examples must be >= 1, got {args.examples}")
    from bench.common import write_json

    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kvcalib-mutations-") as tmp:
        originals = build_originals(Path(args.workdir or tmp), args.recipes)
        built = time.perf_counter()
        tally = campaign(originals, args.examples, args.seed, Path(tmp) / "mutations", tuple(args.modes))
    done = time.perf_counter()
    print("\n".join(tally.lines()))
    print(f"seed {args.seed}; artifacts built in {built - start:.1f} s, {args.examples} mutations judged in "
          f"{done - built:.1f} s")
    write_json(args.json, {"examples": args.examples, "seed": args.seed, "recipes": args.recipes,
                           "modes": args.modes, **tally.as_dict(),
                           "build_s": round(built - start, 2), "campaign_s": round(done - built, 2)})
    if tally.failures:
        total = tally.row(tally.total)
        print("FAILED: " + ", ".join(f"{total[k]} {k}" for k in FINDINGS) + " (silent: accepted and harmful; "
              "exit5: `pipeline show` exited with neither 0 nor 2)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
