"""The artifact contract: manifest format v2 (JSON + one safetensors file), strict validation, and the
round trip CachePolicy <-> (manifest, tensors).

A layer's value policy may carry `rotation: "hadamard"` and `clip: "mse"` (uniform per token, no outliers for the
rotation: exporters.codec.export_refusal) with its sign vector `layers.<i>.value.rotation_signs` [b]; both members
were added within v2 and are written only when set, so their absence means "none" and an artifact without them is
byte for byte what it was (an older loader refuses them as unknown fields instead of mis-decoding).

A loader refuses what it does not fully understand: every cause has its own ManifestError subclass, and
nothing is returned unless every check passed. docs/manifest.md specifies the format for other languages:
the manifest digest, the checksums, the binding of the decoding fields to the tensor file, and the cross-checks
("a consumer must refuse when ...") are each defined once here and stated there.
"""
from __future__ import annotations

import dataclasses
import datetime as _dt
import functools
import hashlib
import json
from importlib import resources
from typing import Any

import torch

from exporters.codec import (FORMATS, FP8, TRANSFORM_AXIS, TRANSFORM_FORMAT, TRANSFORM_SIDE, CachePolicy, CodecError,
                             TensorPolicy, export_refusal, exports_clip, exports_rotation, formats_where)
from exporters.checksums import sha256_bytes
from exporters.errors import InputError
from exporters.layout import MAX_ROW_ENTRIES
from exporters.rotation import rht_signs

FORMAT_NAME = "kvcalib.kv-cache"
FORMAT_VERSION = 2  # 2: manifest digest, raw-byte tensor checksums, bound decoding fields (1 is refused)
TENSOR_FILE = "tensors.safetensors"
DTYPES = {"float32": torch.float32, "float16": torch.float16, "int64": torch.int64}
DIGEST_FIELD = "manifest_digest"       # sha256 of manifest.json with this field's 64 hex digits as 64 '0's
UNSIGNED = "0" * 64
BOUND_KEY = "kvcalib.bound"            # tensors.safetensors __metadata__ entry: a copy of the BOUND_FIELDS
BOUND_FIELDS = ("recipe", "model", "tokenizer", "cache", "layers")   # every field that changes decoding or fit
UPDATABLE = ("evaluation", "runtime_check", "gate")                  # what update_manifest may replace
# the formats an artifact stores (exporters.codec.FORMATS with export axes; the rest is evaluation-only)
EXPORTED = {name: f for name, f in FORMATS.items() if f.exports}


class ManifestError(InputError):
    """Base of every refusal to load (or write) an artifact."""


class UnknownFormatError(ManifestError):
    pass


class VersionMismatchError(ManifestError):
    pass


class SchemaError(ManifestError):
    pass


class ChecksumError(ManifestError):
    pass


class TensorShapeError(ManifestError):
    pass


class MissingTensorError(ManifestError):
    pass


class ModelMismatchError(ManifestError):
    pass


class ConsistencyError(ManifestError):
    """Two fields, or a field and the tensor file, contradict each other (docs/manifest.md, cross-checks)."""


class QuantFieldError(ConsistencyError):
    """bits, axis or group_size do not fit the policy's format."""


class OutlierRuleError(ConsistencyError):
    """outliers.rule / expected_fraction disagree with the fraction, the axis or the format."""


class ZeroPointError(ConsistencyError):
    """zero_point is not the one the format uses."""


class Fp8DtypeError(ConsistencyError):
    """fp8_dtype is absent for fp8, or present for another format."""


class RotationError(ConsistencyError):
    """rotation or clip where the artifact does not carry them (exporters.codec.export_refusal: uniform values per
    token only; a rotation without sparse outliers)."""


class TensorRefError(ConsistencyError):
    """A policy names other tensors than its fields call for, or not under their canonical names."""


class BindingError(ConsistencyError):
    """A decoding field of manifest.json differs from the copy the tensor file's header carries."""


class PrefixError(ConsistencyError):
    """cache.prefix.token_ids differ from the prefix.ids tensor."""


class TensorValueError(ConsistencyError):
    """A calibrated tensor holds values no decoder can use: not finite, a negative or subnormal range, lower >
    upper, an fp8 scale or a smoothing factor out of its meaningful range (check_values)."""


class RecordError(ConsistencyError):
    """runtime_check or gate contradicts itself (a status its own cases or failures do not support)."""


# ---- the manifest's bytes: duplicate-free JSON, signed by its digest --------------------------------------

def _unique_members(pairs: list[tuple[str, Any]]) -> dict:
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        raise SchemaError(f"manifest.json repeats member names {sorted({k for k in keys if keys.count(k) > 1})} "
                          f"in one object (JSON parsers disagree on which one counts)")
    return dict(pairs)


def serialize_manifest(manifest: dict) -> bytes:
    """The bytes of manifest.json: the digest field first, then every other field, signed (docs/manifest.md)."""
    body = {DIGEST_FIELD: UNSIGNED, **{k: v for k, v in manifest.items() if k != DIGEST_FIELD}}
    raw = (json.dumps(body, indent=1) + "\n").encode()  # ASCII: json escapes everything else
    return raw.replace(UNSIGNED.encode(), hashlib.sha256(raw).hexdigest().encode(), 1)  # the first: the digest


def check_digest(raw: bytes, manifest: dict) -> None:
    digest = manifest.get(DIGEST_FIELD)
    if not isinstance(digest, str) or len(digest) != 64 or set(digest) - set("0123456789abcdef"):
        raise SchemaError(f"manifest field {DIGEST_FIELD} must be 64 lowercase hex digits, got {digest!r}")
    if raw.count(digest.encode()) != 1:
        raise ChecksumError(f"manifest.json must hold its {DIGEST_FIELD} exactly once, found it "
                            f"{raw.count(digest.encode())} times")
    if hashlib.sha256(raw.replace(digest.encode(), UNSIGNED.encode())).hexdigest() != digest:
        raise ChecksumError(f"manifest.json does not match its {DIGEST_FIELD}: it was changed after it was written")


def parse_manifest(raw: bytes) -> dict:
    """manifest.json's bytes -> the manifest, refused unless it is duplicate-free JSON of this format and
    version, signed by its digest, valid under the schema and consistent in itself (check_fields)."""
    try:
        manifest = json.loads(raw.decode("utf-8"), object_pairs_hook=_unique_members)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:  # ValueError: JSONDecodeError, and Python's
        # refusal of an integer of more than 4300 digits
        raise SchemaError(f"manifest.json is not valid UTF-8 JSON: {type(exc).__name__}: {str(exc)[:200]}") from None
    _check_format(manifest)
    _check_depth(manifest)
    check_digest(raw, manifest)
    validate_schema(manifest)
    check_fields(manifest)
    return manifest


MAX_DEPTH = 32   # nesting of JSON objects and arrays: a real manifest reaches 6 (model.source.settings); deeper
                 # input is refused before any recursive reader (schema, comparisons, printing) walks it


def nested_too_deep(value) -> str | None:
    """The path of the first JSON object or array nested deeper than MAX_DEPTH (None: none), walked without
    recursion: untrusted input is never handed to a recursive reader before this (manifest.json here, a
    checkpoint's side files in exporters/artifact.py)."""
    stack = [(value, 1, "")]
    while stack:
        node, depth, path = stack.pop()
        if depth > MAX_DEPTH:
            return path[1:] or "(root)"
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        stack.extend((v, depth + 1, f"{path}/{k}") for k, v in items if isinstance(v, (dict, list)))
    return None


def _check_depth(manifest: dict) -> None:
    deep = nested_too_deep(manifest)
    if deep is not None:
        raise SchemaError(f"manifest field {deep}: nesting deeper than {MAX_DEPTH} levels of objects and arrays is "
                          f"not allowed")


# ---- schema -----------------------------------------------------------------------------------------------

def schema() -> dict:
    return json.loads(resources.files("exporters").joinpath("manifest.schema.json").read_text())


def _check_format(manifest: Any) -> None:
    if not isinstance(manifest, dict):
        raise SchemaError(f"manifest must be a JSON object, got {type(manifest).__name__}")
    if manifest.get("format") != FORMAT_NAME:
        raise UnknownFormatError(f"manifest format must be {FORMAT_NAME!r}, got {manifest.get('format')!r}")
    version = manifest.get("format_version")
    if isinstance(version, (bool, float)):  # 2.0 and True compare equal to integers; neither is one
        raise SchemaError(f"manifest field format_version: {version!r} is not of type 'integer'")
    if version != FORMAT_VERSION:
        raise VersionMismatchError(f"manifest format_version {manifest.get('format_version')!r} is not supported "
                                   f"by this loader (it reads version {FORMAT_VERSION})")


@functools.cache
def _validator():
    """Draft 2020-12, except that an integer is a JSON integer: 1.0 (which the draft counts as one) is refused
    where the schema says integer, so every count, index and id loads as an int."""
    import jsonschema

    strict = jsonschema.Draft202012Validator.TYPE_CHECKER.redefine(
        "integer", lambda _checker, x: isinstance(x, int) and not isinstance(x, bool))
    return jsonschema.validators.extend(jsonschema.Draft202012Validator, type_checker=strict)(schema())


def _precise(error):
    """The error to report: inside a oneOf / anyOf (runtime_check, gate, cache.prefix / smoothing: null or an
    object) the branch's own error that reaches deepest into the instance, so the message names the field
    (runtime_check/cases/0/context) rather than the whole object; at one field a type error first (4.0 fails
    both `type: integer` and the enum of bits, and the type says why)."""
    while error.context:
        deepest = max(error.context, key=lambda e: (len(e.absolute_path), e.validator == "type"))
        if len(deepest.absolute_path) <= len(error.absolute_path):  # no branch got further: "valid under none"
            return error
        error = deepest
    return error


def validate_schema(manifest: Any) -> None:
    _check_format(manifest)
    errors = sorted((_precise(e) for e in _validator().iter_errors(manifest)),
                    key=lambda e: (list(e.absolute_path), e.validator != "type"))
    if errors:
        e = errors[0]
        where = "/".join(str(p) for p in e.absolute_path) or "(root)"
        raise SchemaError(f"manifest field {where}: {e.message}")


# ---- cross-checks: the manifest alone ---------------------------------------------------------------------

def outlier_rule(fmt: str, axis: str, fraction: float) -> str:
    """The sparse-outlier rule the codec applies (codec.encode): static bounds per channel, per-token quantiles."""
    if fraction == 0 or not FORMATS[fmt].outliers:
        return "none"
    return "static_channel_bounds" if axis == "channel" else "per_token_quantile"


def needed_tensors(p: dict) -> tuple[str, ...]:
    """The calibrated tensors a TensorPolicy's fields call for, in codec.CALIBRATED_FIELDS order."""
    fmt, channel = p["format"], p["axis"] == "channel"
    names = ("codebook",) if fmt == "nuq" else ()
    names += ("zero", "range") if fmt == "nuq" and channel else ()
    names += ("lower", "upper") if channel and outlier_rule(fmt, p["axis"], p["outliers"]["fraction"]) != "none" else ()
    names += ("fp8_scale",) if fmt == "fp8" else ()
    return names + (("rotation_signs",) if p.get("rotation") == "hadamard" else ())


def _check_placement(p: dict, where: str, kind: str) -> None:
    """rotation / clip only where the codec's export rule puts them (exports_rotation, exports_clip)."""
    fmt, axis, fraction = p["format"], p["axis"], p["outliers"]["fraction"]
    given = f"on a {kind} of format {fmt} with axis {axis} and outliers/fraction {fraction!r}"
    rule = f"allowed only on {TRANSFORM_SIDE}s of format {TRANSFORM_FORMAT} with axis {TRANSFORM_AXIS}"
    if "rotation" in p and not exports_rotation(kind, fmt, axis, fraction):
        raise RotationError(f"{where}/rotation: {rule} and no sparse outliers (outliers/fraction 0); got "
                            f"{p['rotation']!r} {given}")
    if "clip" in p and not exports_clip(kind, fmt, axis):
        raise RotationError(f"{where}/clip: {rule}; got {p['clip']!r} {given}")


def _check_policy_fields(p: dict, where: str, kind: str) -> None:
    fmt, axis, bits, group = p["format"], p["axis"], p["bits"], p["group_size"]
    f = EXPORTED[fmt]
    if bits not in f.bits:
        raise QuantFieldError(f"{where}/bits: format {fmt} allows {list(f.bits)}, got {bits!r}")
    if axis not in f.export_axes:  # the codec's evaluation-only axes (fp8 token / unscaled) are refused here
        raise QuantFieldError(f"{where}/axis: format {fmt} allows {list(f.export_axes)}, got {axis!r}")
    grouped = axis in f.group_axes
    if (group >= 1) != grouped:
        allowed = "an integer >= 1 (tokens per scale group)" if grouped else "0 (only uniform per-channel groups)"
        raise QuantFieldError(f"{where}/group_size: format {fmt} with axis {axis} allows {allowed}, got {group!r}")
    zero_point = f.zero_point
    if p["zero_point"] != zero_point:
        raise ZeroPointError(f"{where}/zero_point: format {fmt} allows {zero_point!r}, got {p['zero_point']!r}")
    if ("fp8_dtype" in f.settings) != ("fp8_dtype" in p):
        only = "/".join(formats_where(lambda g: "fp8_dtype" in g.settings))
        allowed = f"one of {list(FP8)}" if "fp8_dtype" in f.settings else f"no fp8_dtype field ({only} only)"
        raise Fp8DtypeError(f"{where}/fp8_dtype: format {fmt} allows {allowed}, got {p.get('fp8_dtype', '(absent)')!r}")
    out = p["outliers"]
    if out["fraction"] != 0 and not f.outliers:
        raise OutlierRuleError(f"{where}/outliers/fraction: format {fmt} stores no sparse outliers; allowed 0, "
                               f"got {out['fraction']!r}")
    rule = outlier_rule(fmt, axis, out["fraction"])
    if out["rule"] != rule:
        raise OutlierRuleError(f"{where}/outliers/rule: with fraction {out['fraction']!r} and axis {axis} the codec "
                               f"applies {rule!r}; allowed {rule!r}, got {out['rule']!r}")
    if "expected_fraction" in out and rule == "none":
        raise OutlierRuleError(f"{where}/outliers/expected_fraction: allowed only when outliers are stored "
                               f"(fraction > 0), got {out['expected_fraction']!r} with fraction {out['fraction']!r}")
    _check_placement(p, where, kind)


def _check_refs(manifest: dict) -> None:
    """Every tensor reference has its canonical name: what a field means is fixed by the name in the file."""
    for i, layer in enumerate(manifest["layers"]):
        for kind in ("key", "value"):
            want = {name: f"layers.{i}.{kind}.{name}" for name in needed_tensors(layer[kind])}
            if layer[kind]["tensors"] != want:
                raise TensorRefError(f"layers/{i}/{kind}/tensors: format {layer[kind]['format']}, axis "
                                     f"{layer[kind]['axis']}, outlier fraction {layer[kind]['outliers']['fraction']}, "
                                     f"rotation {layer[kind].get('rotation', 'none')} allow exactly {want}, got "
                                     f"{layer[kind]['tensors']}")
    cache = manifest["cache"]
    for field, got, want in (("smoothing", cache["smoothing"], {"tensor": "smooth"}),
                             ("prefix/tensors", (cache["prefix"] or {}).get("tensors"),
                              {"k": "prefix.k", "v": "prefix.v", "ids": "prefix.ids"})):
        if got is not None and got != want:
            raise TensorRefError(f"cache/{field}: allowed {want}, got {got}")


def _check_records(manifest: dict) -> None:
    """runtime_check and gate: the status a consumer reads is the one their own contents support."""
    rc = manifest["runtime_check"]
    if rc is not None:
        cases = rc["cases"]
        failed = sum(not c["ok"] for c in cases)
        canary_ok = rc.get("canary", {}).get("ok", True)
        status = "passed" if cases and not failed and "error" not in rc and canary_ok else "failed"
        if rc["status"] != status:
            raise RecordError(f"runtime_check/status: {len(cases)} cases, {failed} not ok, "
                              f"{'an' if 'error' in rc else 'no'} error, canary "
                              f"{'absent' if 'canary' not in rc else 'ok' if canary_ok else 'failed'} allow "
                              f"{status!r}, got {rc['status']!r}")
        for key in ("max_abs_err", "max_rel_err"):
            worst = max((c[key] for c in cases), default=None)
            if rc[key] != worst:
                raise RecordError(f"runtime_check/{key}: the maximum over cases is {worst!r}, got {rc[key]!r}")
    gate = manifest.get("gate")
    if gate is not None and gate["passed"] != (not gate["failures"]):
        raise RecordError(f"gate/passed: {len(gate['failures'])} failures allow {not gate['failures']}, "
                          f"got {gate['passed']}")


def _check_attention(model: dict) -> None:
    """model.attention and model.rope.local come together (a model with sliding-window layers), with one layer
    type per layer and at least one sliding layer."""
    attention, local = model.get("attention"), model["rope"].get("local")
    if (attention is None) != (local is None):
        raise ConsistencyError(f"model/attention and model/rope/local must both be present (sliding-window layers) "
                               f"or both absent (every layer global); got attention "
                               f"{'present' if attention is not None else 'absent'}, rope/local "
                               f"{'present' if local is not None else 'absent'}")
    if attention is None:
        return
    types = attention["layer_types"]
    if len(types) != model["n_layers"] or "sliding" not in types:
        raise ConsistencyError(f"model/attention/layer_types: allowed one of 'full' / 'sliding' per layer "
                               f"({model['n_layers']}), at least one 'sliding'; got {types}")


def _check_row_entries(manifest: dict) -> None:
    """Sparse outliers are stored with an int16 index h * D + d within the token's H_kv * D entries
    (exporters/layout.py): a model with more entries per row than int16 holds cannot store them."""
    model = manifest["model"]
    entries = model["n_kv_heads"] * model["head_dim"]
    if entries <= MAX_ROW_ENTRIES:
        return
    for i, layer in enumerate(manifest["layers"]):
        for kind in ("key", "value"):
            if layer[kind]["outliers"]["rule"] != "none":
                raise ConsistencyError(
                    f"layers/{i}/{kind}/outliers: sparse outliers are indexed by an int16 h * head_dim + d, so "
                    f"model/n_kv_heads * model/head_dim must be at most {MAX_ROW_ENTRIES}; got "
                    f"{model['n_kv_heads']} * {model['head_dim']} = {entries}")


def check_fields(manifest: dict) -> None:
    """The cross-checks a schema cannot state (docs/manifest.md, "a consumer must refuse when"), on a
    schema-valid manifest."""
    model = manifest["model"]
    n_layers = model["n_layers"]
    # the count first: work proportional to a claimed n_layers (a range of 2e8) is never done for a short list
    if len(manifest["layers"]) != n_layers or any(layer["index"] != i for i, layer in enumerate(manifest["layers"])):
        raise SchemaError(f"layers must list indices 0..{n_layers - 1} in order (model/n_layers = {n_layers}), got "
                          f"{len(manifest['layers'])} layers")
    if model["n_q_heads"] % model["n_kv_heads"]:
        raise ConsistencyError(f"model/n_q_heads must be a multiple of model/n_kv_heads (grouped-query attention), "
                               f"got {model['n_q_heads']} and {model['n_kv_heads']}")
    _check_attention(model)
    _check_row_entries(manifest)
    for i, layer in enumerate(manifest["layers"]):
        for kind in ("key", "value"):
            _check_policy_fields(layer[kind], f"layers/{i}/{kind}", kind)
    _check_refs(manifest)
    _check_records(manifest)


# ---- cross-checks: the manifest against the tensor file and the served model -------------------------------

def json_difference(a: Any, b: Any, path: str) -> tuple[str, Any, Any] | None:
    """The first place where two JSON values differ: (path, a's value, b's value). Numbers compare by value
    (1 == 1.0), booleans only with booleans."""
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            if k not in a or k not in b:
                return f"{path}/{k}", a.get(k, "(absent)"), b.get(k, "(absent)")
            if found := json_difference(a[k], b[k], f"{path}/{k}"):
                return found
        return None
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return next(filter(None, (json_difference(x, y, f"{path}/{i}") for i, (x, y) in enumerate(zip(a, b)))), None)
    same = (a is b) if isinstance(a, bool) or isinstance(b, bool) else \
        (type(a) is type(b) or {type(a), type(b)} <= {int, float}) and a == b
    return None if same else (path, a, b)


def bound_metadata(manifest: dict) -> dict[str, str]:
    """The tensor file's __metadata__: the BOUND_FIELDS, so that tensor_file.sha256 covers them too."""
    return {BOUND_KEY: json.dumps({f: manifest[f] for f in BOUND_FIELDS}, sort_keys=True, separators=(",", ":"))}


def check_binding(manifest: dict, metadata: dict[str, str]) -> None:
    """Every BOUND_FIELDS field equals the copy in the tensor file's header (written at calibration time)."""
    try:
        bound = json.loads(metadata[BOUND_KEY])
    except (KeyError, TypeError, ValueError, RecursionError):
        bound = None
    if not isinstance(bound, dict):
        raise BindingError(f"{TENSOR_FILE} has no valid __metadata__ {BOUND_KEY!r}: the decoding fields of the "
                           f"manifest cannot be checked against it")
    if found := json_difference({f: manifest[f] for f in BOUND_FIELDS}, bound, ""):
        path, ours, theirs = found
        raise BindingError(f"manifest field {path[1:]} is {ours!r}, but {TENSOR_FILE} (__metadata__ {BOUND_KEY}, "
                           f"covered by tensor_file.sha256) was written for {theirs!r}")


def implied_tensors(manifest: dict) -> dict[str, tuple[tuple[int, ...], str]]:
    """Every tensor the manifest's fields call for: canonical name -> (shape, dtype)."""
    m = manifest["model"]
    h, d, n_layers = m["n_kv_heads"], m["head_dim"], m["n_layers"]
    out: dict[str, tuple[tuple[int, ...], str]] = {}
    for i, layer in enumerate(manifest["layers"]):
        for kind in ("key", "value"):
            p = layer[kind]
            for name in needed_tensors(p):
                shape = {"codebook": (2 ** p["bits"],), "fp8_scale": () if p["axis"] == "tensor" else (h,),
                         "rotation_signs": (d & -d,)}
                out[f"layers.{i}.{kind}.{name}"] = (shape.get(name, (h, d)), "float32")
    cache = manifest["cache"]
    if cache["smoothing"]:
        out["smooth"] = ((n_layers, h, d), "float32")
    if cache["prefix"]:
        n = len(cache["prefix"]["token_ids"])
        out["prefix.k"] = out["prefix.v"] = ((n_layers, h, n, d), "float32")
        out["prefix.ids"] = ((n,), "int64")
    return out


def check_tensors(manifest: dict, tensors: dict[str, torch.Tensor]) -> None:
    """Declared entries, implied shapes and dtypes, and per-tensor sha256 (of the raw bytes) all agree; nothing
    missing or extra; the prefix tensor holds the prefix token ids."""
    declared = manifest["tensors"]
    implied = implied_tensors(manifest)
    for ref in implied:
        if ref not in declared:
            raise MissingTensorError(f"tensor {ref!r} is referenced by the manifest but not declared in 'tensors'")
    for ref, entry in declared.items():
        if ref not in implied:
            raise SchemaError(f"tensor {ref!r} is declared but no manifest field uses it")
        if ref not in tensors:
            raise MissingTensorError(f"tensor {ref!r} is missing from {TENSOR_FILE}")
        t = tensors[ref]
        want_shape, want_dtype = implied[ref]
        if tuple(entry["shape"]) != want_shape or tuple(t.shape) != want_shape:
            raise TensorShapeError(f"tensor {ref!r}: shape {tuple(t.shape)} (declared {tuple(entry['shape'])}); "
                                   f"the manifest fields imply {want_shape}")
        if entry["dtype"] != want_dtype or t.dtype != DTYPES[want_dtype]:
            raise TensorShapeError(f"tensor {ref!r}: dtype {t.dtype}, declared {entry['dtype']}; the manifest "
                                   f"fields imply {want_dtype}")
        if sha256_bytes(t) != entry["sha256"]:
            raise ChecksumError(f"tensor {ref!r}: sha256 does not match the manifest")
    extra = sorted(set(tensors) - set(declared))
    if extra:
        raise SchemaError(f"{TENSOR_FILE} holds tensors the manifest does not declare: {extra[:5]}")
    check_values(manifest, tensors)
    prefix = manifest["cache"]["prefix"]
    if prefix and tensors["prefix.ids"].tolist() != prefix["token_ids"]:
        raise PrefixError(f"cache/prefix/token_ids {prefix['token_ids']} differ from the prefix.ids tensor "
                          f"{tensors['prefix.ids'].tolist()} (the ids the prefix K/V were computed from)")


FP16_MAX = 65504.0   # the largest float16: the served cache holds sink, residual and prefix rows in fp16
FP16_TINY = 2.0 ** -24   # the smallest positive float16 (a subnormal): the finest value the fp16 cache holds
F32_NORMAL = float(torch.finfo(torch.float32).tiny)   # 2^-126, the smallest normal float32: below it (a subnormal)
                                                      # a value has no finite reciprocal (1 / 1e-45 = inf)




def _bad(t: torch.Tensor, ok: torch.Tensor) -> str:
    """Where `ok` fails first, and the value there (for the refusal's message)."""
    flat = (~ok).flatten().nonzero()
    i = int(flat[0])
    index = tuple(int(x) for x in torch.unravel_index(torch.tensor(i), ok.shape)) if ok.dim() else ()
    return f"{int((~ok).sum())} of {ok.numel()} entries, first at {list(index)}: {float(t.flatten()[i])!r}"


def check_values(manifest: dict, tensors: dict[str, torch.Tensor]) -> None:
    """Every calibrated tensor holds values a decoder can use (checksums do not say that: anyone can recompute
    them), each refusal naming the tensor, the rule, the first offending value and its index:
    - finite everywhere;
    - range: 0 (a constant channel: it decodes to its zero-point) or a normal float32 (>= 2^-126). Below that a
      range is no measurement of K/V -- calibration takes it from float16 / bfloat16 keys whose spreads are orders
      of magnitude larger, so an honest near-constant channel stays far above it -- and it has no finite
      reciprocal (1 / range = inf), which a kernel multiplying by it turns into inf or NaN;
    - lower <= upper in every channel (static outlier bounds), see below;
    - an fp8 scale s in [FP16_TINY / fp8_max, FP16_MAX / fp8_max]: every decoded value (a code times s, |code| <=
      fp8_max) fits float16 as the K/V it was calibrated on did, and the largest is not below float16's smallest
      positive value (a smaller scale decodes the whole tensor or head to zero in the float16 cache, and 1e-45 is a
      float32 subnormal whose reciprocal, x / s on the way in, is inf; the run writes s = 1 for an all-zero amax);
    - rotation signs exactly +1 or -1 (anything else is no rotation: the decode would scale the row);
    - smoothing factors (SmoothAttention lambda) >= FP16_TINY: the cache stores K / lambda, its sink and recent rows
      in float16, so below 2^-24 every key above 65504 * 2^-24 ~ 0.0039 in magnitude overflows there (a subnormal
      lambda divides to inf at the first flush); calibration gives lambda = max|K|^alpha / max|Q|^beta, 1 for a
      dead channel, far above it;
    - prefix K/V within float16 (the cache holds them in fp16)."""
    def refuse(name: str, rule: str, t: torch.Tensor, ok: torch.Tensor) -> None:
        if not bool(ok.all()):
            raise TensorValueError(f"tensor {name!r}: {rule}; {_bad(t, ok)}")

    for name, t in sorted(tensors.items()):
        if t.is_floating_point():
            refuse(name, "values must be finite (no NaN or inf)", t, torch.isfinite(t))
    for i, layer in enumerate(manifest["layers"]):
        for kind in ("key", "value"):
            p, refs = layer[kind], layer[kind]["tensors"]
            if "range" in refs:
                t = tensors[refs["range"]]
                refuse(refs["range"], "range must be >= 0 (0 only for a constant channel)", t, t >= 0)
                refuse(refs["range"], f"range must be 0 (a constant channel) or a normal float32 >= {F32_NORMAL:g} "
                                      f"(2^-126; a subnormal range has no finite reciprocal)", t,
                       (t == 0) | (t >= F32_NORMAL))
            if "lower" in refs:
                # lower == upper is allowed: Gemma 3 270M has key channels that are exactly 0 on every token (its
                # k_norm), and honest bounds of such a channel are 0 and 0 (3 of layer 0's 256 channels). Bounds
                # equal on a channel that varies make its entries outliers beyond the declared fraction: the
                # serving cache caps what it holds at (1 + OUTLIER_MARGIN) x the declared count (serving/cache.py).
                lo, hi = tensors[refs["lower"]], tensors[refs["upper"]]
                refuse(refs["lower"], f"lower must be <= upper ({refs['upper']}) in every channel", lo, lo <= hi)
            if "fp8_scale" in refs:
                fmax = FP8[p["fp8_dtype"]][1]
                t, low, top = tensors[refs["fp8_scale"]], FP16_TINY / fmax, FP16_MAX / fmax
                refuse(refs["fp8_scale"], f"an fp8 scale must be in [{low:.6g}, {top:g}] (fp16's smallest positive "
                                          f"2^-24 / {p['fp8_dtype']} max, fp16 max / {p['fp8_dtype']} max)",
                       t, (t >= low) & (t <= top))
            if "rotation_signs" in refs:
                t = tensors[refs["rotation_signs"]]
                refuse(refs["rotation_signs"], "rotation_signs entries must be exactly +1 or -1", t,
                       (t == 1) | (t == -1))
    cache = manifest["cache"]
    if cache["smoothing"]:
        t = tensors[cache["smoothing"]["tensor"]]
        refuse(cache["smoothing"]["tensor"], f"smoothing factors must be >= {FP16_TINY:g} (2^-24, fp16's smallest "
                                             f"positive: the cache holds K / lambda in fp16)", t, t >= FP16_TINY)
    if cache["prefix"]:
        for ref in ("k", "v"):
            name = cache["prefix"]["tensors"][ref]
            t = tensors[name]
            refuse(name, f"prefix rows must be within float16 (|x| <= {FP16_MAX:g})", t, t.abs() <= FP16_MAX)


def model_json(spec) -> dict:
    """The manifest's `model` field for a pipeline.model.ModelSpec (written at export, compared at load). A model
    with sliding-window (local) layers also has `attention` {layer_types, sliding_window} and `rope.local` {theta,
    scaling}, the RoPE of its local layers; one without has neither (every layer global, one RoPE). `vocab_size`
    (the logits' width) lets a reader judge the recorded evaluation without the model (pipeline.sanity: a reference
    perplexity near it is a model predicting at chance); artifacts made before it lack it."""
    out = {"name": spec.name, "architecture": spec.architecture, "n_layers": spec.n_layers,
           "n_q_heads": spec.n_q_heads, "n_kv_heads": spec.n_kv_heads, "head_dim": spec.head_dim,
           "rope": {"theta": spec.rope_theta, "scaling": json.loads(spec.rope_scaling), "pairing": spec.rope_pairing},
           "max_positions": spec.max_positions, "vocab_size": spec.vocab_size, "sha256": spec.model_sha256}
    layer_types = list(getattr(spec, "layer_types", ()) or ())
    if layer_types:
        out["attention"] = {"layer_types": layer_types, "sliding_window": spec.sliding_window}
        out["rope"]["local"] = {"theta": spec.rope_local_theta, "scaling": json.loads(spec.rope_local_scaling)}
    if getattr(spec, "source", None):  # where it came from: provenance, never compared (check_model)
        out["source"] = spec.source
    return out


def tokenizer_json(spec) -> dict:
    return {"sha256": spec.tokenizer_sha256, "bos_token_id": spec.bos_token_id}


def check_model(manifest: dict, spec) -> None:
    """The served model is the one calibrated: weights, shapes, RoPE (theta, scaling, pairing), positions,
    vocabulary size (where recorded: artifacts made before it lack it), architecture and tokenizer; the model's name
    and where it was loaded from (model.source) may differ."""
    recorded = {"model": {k: v for k, v in manifest["model"].items() if k != "source"},
                "tokenizer": manifest["tokenizer"]}
    unrecorded = {"source"} | ({"vocab_size"} - set(manifest["model"]))
    served = {"model": {**{k: v for k, v in model_json(spec).items() if k not in unrecorded},
                        "name": manifest["model"]["name"]}, "tokenizer": tokenizer_json(spec)}
    if found := json_difference(recorded, served, ""):
        path, ours, theirs = found
        raise ModelMismatchError(f"artifact was calibrated for model {manifest['model']['name']} with "
                                 f"{path[1:]}={ours!r}; the model given has {path[1:]}={theirs!r}")
    prefix = manifest["cache"]["prefix"]
    if prefix and max(prefix["token_ids"]) >= spec.vocab_size:
        raise ModelMismatchError(f"cache/prefix/token_ids: the model given has {spec.vocab_size} tokens, "
                                 f"got id {max(prefix['token_ids'])}")


# ---- CachePolicy <-> manifest ------------------------------------------------------------------------------

def _tensor_policy_json(p: TensorPolicy, prefix: str, tensors: dict[str, torch.Tensor], expected: float | None,
                        kind: str, head_dim: int | None) -> dict:
    """One layer's key or value policy (kind) as the manifest writes it, its calibrated tensors added to `tensors`
    under their canonical names. A rotated policy without signs stores the seeded ones the codec used (head_dim
    sizes them)."""
    where = prefix.replace(".", "/")
    if p.format not in EXPORTED or p.axis not in EXPORTED[p.format].export_axes:  # an evaluation-only format
        allowed = {name: list(f.export_axes) for name, f in EXPORTED.items()}
        raise QuantFieldError(f"{where}/format: the artifact allows format/axis {allowed}, got format {p.format!r} "
                              f"with axis {p.axis!r} (evaluation-only)")
    refusal = export_refusal(p, kind, prefix)
    if refusal is not None:  # fp8 rounding, or a rotation / clip where the artifact does not carry them
        raise (QuantFieldError if p.fp8_rounding != "nearest" else RotationError)(refusal)
    if p.rotation == "hadamard":
        b = head_dim & -head_dim
        if p.rotation_signs is None:
            p = dataclasses.replace(p, rotation_signs=rht_signs(b))
        if tuple(p.rotation_signs.shape) != (b,):
            raise TensorShapeError(f"{where}/tensors/rotation_signs: model/head_dim {head_dim} implies [{b}], got "
                                   f"shape {list(p.rotation_signs.shape)}")
    names = {}
    for name, t in p.calibrated().items():
        key = f"{prefix}.{name}"
        tensors[key] = t.detach().float().contiguous().cpu()
        names[name] = key
    rule = outlier_rule(p.format, p.axis, p.outlier_fraction)
    out = {"format": p.format, "bits": p.bits, "axis": p.axis, "group_size": p.group_size,
           "zero_point": FORMATS[p.format].zero_point,
           "outliers": {"fraction": p.outlier_fraction, "rule": rule}, "tensors": names}
    if expected is not None and rule != "none":
        out["outliers"]["expected_fraction"] = expected
    if "fp8_dtype" in FORMATS[p.format].settings:
        out["fp8_dtype"] = p.fp8_dtype
    if p.rotation != "none":  # members added within v2: written only when set (absent = "none")
        out["rotation"] = p.rotation
    if p.clip != "none":
        out["clip"] = p.clip
    return out


def build_manifest(policy: CachePolicy, spec, provenance: dict, evaluation: dict | None = None,
                   prefix: dict | None = None, creator: dict | None = None) -> tuple[dict, dict[str, torch.Tensor]]:
    """-> (manifest, tensors by name); native.write_artifact fills tensor_file and the digest.
    prefix: {"token_ids": [...], "k": [L, H, P, D] post-RoPE keys, "v": [L, H, P, D]} or None. spec: the model's
    ModelSpec (its head_dim sizes a rotation's signs)."""
    tensors: dict[str, torch.Tensor] = {}
    measured = (evaluation or {}).get(policy.name, {})
    head_dim = None if spec is None else spec.head_dim   # None: a policy refused before the model is read
    layers = []
    for i, (pk, pv) in enumerate(policy.layers):
        layers.append({"index": i,
                       "key": _tensor_policy_json(pk, f"layers.{i}.key", tensors, measured.get("outlier_fraction_k"),
                                                  "key", head_dim),
                       "value": _tensor_policy_json(pv, f"layers.{i}.value", tensors,
                                                    measured.get("outlier_fraction_v"), "value", head_dim)})
    smoothing = None
    if policy.smooth is not None:
        tensors["smooth"] = policy.smooth.detach().float().contiguous().cpu()
        smoothing = {"tensor": "smooth"}
    prefix_json = None
    if prefix is not None:
        tensors["prefix.k"] = prefix["k"].detach().float().contiguous().cpu()
        tensors["prefix.v"] = prefix["v"].detach().float().contiguous().cpu()
        tensors["prefix.ids"] = torch.tensor([int(t) for t in prefix["token_ids"]], dtype=torch.int64)
        prefix_json = {"token_ids": tensors["prefix.ids"].tolist(),
                       "tensors": {"k": "prefix.k", "v": "prefix.v", "ids": "prefix.ids"}}
    manifest = {
        DIGEST_FIELD: UNSIGNED,
        "format": FORMAT_NAME, "format_version": FORMAT_VERSION,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "creator": creator or {"package": "kvcalib", "version": "unknown", "git_sha": "unknown"},
        "model": model_json(spec),
        "tokenizer": tokenizer_json(spec),
        "recipe": policy.name,
        "cache": {"key_rope": policy.key_rope, "n_sink": policy.n_sink, "residual": policy.residual,
                  "layout": "B,H_kv,T,D", "smoothing": smoothing, "prefix": prefix_json},
        "layers": layers,
        "tensors": {name: {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "sha256": sha256_bytes(t)}
                    for name, t in sorted(tensors.items())},
        "tensor_file": {"name": TENSOR_FILE, "sha256": UNSIGNED},
        "calibration": provenance,
        "evaluation": evaluation or {},
        "runtime_check": None,
    }
    return manifest, tensors


def _policy_from_json(p: dict, tensors: dict[str, torch.Tensor], where: str) -> TensorPolicy:
    kw = {name: tensors[ref] for name, ref in p["tensors"].items()}
    tp = TensorPolicy(format=p["format"], bits=p["bits"], axis=p["axis"], group_size=p["group_size"],
                      outlier_fraction=p["outliers"]["fraction"], fp8_dtype=p.get("fp8_dtype", TensorPolicy.fp8_dtype),
                      rotation=p.get("rotation", "none"), clip=p.get("clip", "none"), **kw)
    try:
        tp.validate(where)
    except CodecError as exc:
        raise SchemaError(str(exc)) from None
    return tp


def policy_from_manifest(manifest: dict, tensors: dict[str, torch.Tensor]) -> CachePolicy:
    """The CachePolicy of a checked manifest (check_fields, check_tensors): the prefix ids come from the
    prefix.ids tensor."""
    pairs = [(_policy_from_json(layer["key"], tensors, f"layers/{i}/key"),
              _policy_from_json(layer["value"], tensors, f"layers/{i}/value"))
             for i, layer in enumerate(manifest["layers"])]
    cache = manifest["cache"]
    smooth = tensors[cache["smoothing"]["tensor"]] if cache["smoothing"] else None  # checked: check_values
    prefix_ids = tensors[cache["prefix"]["tensors"]["ids"]] if cache["prefix"] else None
    return CachePolicy(name=manifest["recipe"], layers=pairs, key_rope=cache["key_rope"], n_sink=cache["n_sink"],
                       residual=cache["residual"], smooth=smooth, prefix_ids=prefix_ids,
                       prefix_len=0 if prefix_ids is None else int(prefix_ids.numel()),
                       model=model_binding(manifest["model"]))


BINDING_FIELDS = ("n_layers", "n_q_heads", "n_kv_heads", "head_dim", "rope", "attention", "max_positions")


def model_binding(model: dict) -> dict:
    """What of the manifest's `model` a serving cache must match in the model it is handed (no weights hash, no
    name: those need the tokenizer and weights, which check_model compares): layers, heads, head_dim, the RoPE
    (theta, scaling, pairing, local), the sliding-window layers and the positions."""
    return {k: model[k] for k in BINDING_FIELDS if k in model}
