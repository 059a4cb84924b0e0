"""The artifact contract: manifest format v1 (JSON + one safetensors file), strict validation, and the
round trip CachePolicy <-> (manifest, tensors).

A loader refuses what it does not fully understand: every cause has its own ManifestError subclass, and
nothing is returned unless every check passed. docs/manifest.md specifies the format for other languages.
"""
from __future__ import annotations

import datetime as _dt
import json
from importlib import resources
from typing import Any

import torch

from exporters.codec import CachePolicy, CodecError, TensorPolicy
from exporters.checksums import sha256_tensor

FORMAT_NAME = "kvcalib.kv-cache"
FORMAT_VERSION = 1
TENSOR_FILE = "tensors.safetensors"
DTYPES = {"float32": torch.float32, "float16": torch.float16, "int64": torch.int64}


class ManifestError(ValueError):
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


def schema() -> dict:
    return json.loads(resources.files("exporters").joinpath("manifest.schema.json").read_text())


def validate_schema(manifest: Any) -> None:
    import jsonschema

    if not isinstance(manifest, dict):
        raise SchemaError(f"manifest must be a JSON object, got {type(manifest).__name__}")
    if manifest.get("format") != FORMAT_NAME:
        raise UnknownFormatError(f"manifest format must be {FORMAT_NAME!r}, got {manifest.get('format')!r}")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise VersionMismatchError(f"manifest format_version {manifest.get('format_version')!r} is not supported "
                                   f"by this loader (it reads version {FORMAT_VERSION})")
    validator = jsonschema.Draft202012Validator(schema())
    errors = sorted(validator.iter_errors(manifest), key=lambda e: list(e.absolute_path))
    if errors:
        e = errors[0]
        where = "/".join(str(p) for p in e.absolute_path) or "(root)"
        raise SchemaError(f"manifest field {where}: {e.message}")


def _tensor_policy_json(p: TensorPolicy, prefix: str, tensors: dict[str, torch.Tensor], expected: float | None) -> dict:
    names = {}
    for name, t in p.calibrated().items():
        key = f"{prefix}.{name}"
        tensors[key] = t.detach().float().contiguous().cpu()
        names[name] = key
    rule = "none"
    if p.outlier_fraction > 0:
        rule = "static_channel_bounds" if p.axis == "channel" else "per_token_quantile"
    out = {"format": p.format, "bits": p.bits, "axis": p.axis, "group_size": p.group_size,
           "zero_point": {"uniform": "min", "nuq": "midpoint"}.get(p.format, "none"),
           "outliers": {"fraction": p.outlier_fraction, "rule": rule}, "tensors": names}
    if expected is not None and p.outlier_fraction > 0:
        out["outliers"]["expected_fraction"] = expected
    if p.format == "fp8":
        out["fp8_dtype"] = p.fp8_dtype
    return out


def build_manifest(policy: CachePolicy, spec, provenance: dict, evaluation: dict | None = None,
                   prefix: dict | None = None, creator: dict | None = None) -> tuple[dict, dict[str, torch.Tensor]]:
    """-> (manifest without tensor checksums filled for the file, tensors by name). native.write fills the rest.
    prefix: {"token_ids": [...], "k": [L, H, P, D] post-RoPE keys, "v": [L, H, P, D]} or None."""
    tensors: dict[str, torch.Tensor] = {}
    measured = (evaluation or {}).get(policy.name, {})
    layers = []
    for i, (pk, pv) in enumerate(policy.layers):
        layers.append({"index": i,
                       "key": _tensor_policy_json(pk, f"layers.{i}.key", tensors, measured.get("outlier_fraction_k")),
                       "value": _tensor_policy_json(pv, f"layers.{i}.value", tensors, measured.get("outlier_fraction_v"))})
    smoothing = None
    if policy.smooth is not None:
        tensors["smooth"] = policy.smooth.detach().float().contiguous().cpu()
        smoothing = {"tensor": "smooth"}
    prefix_json = None
    if prefix is not None:
        tensors["prefix.k"] = prefix["k"].detach().float().contiguous().cpu()
        tensors["prefix.v"] = prefix["v"].detach().float().contiguous().cpu()
        prefix_json = {"token_ids": [int(t) for t in prefix["token_ids"]], "tensors": {"k": "prefix.k", "v": "prefix.v"}}
    manifest = {
        "format": FORMAT_NAME, "format_version": FORMAT_VERSION,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "creator": creator or {"package": "kvcalib", "version": "unknown", "git_sha": "unknown"},
        "model": {"name": spec.name, "architecture": spec.architecture, "n_layers": spec.n_layers,
                  "n_q_heads": spec.n_q_heads, "n_kv_heads": spec.n_kv_heads, "head_dim": spec.head_dim,
                  "rope": {"theta": spec.rope_theta, "scaling": json.loads(spec.rope_scaling), "pairing": spec.rope_pairing},
                  "max_positions": spec.max_positions, "sha256": spec.model_sha256},
        "tokenizer": {"sha256": spec.tokenizer_sha256, "bos_token_id": spec.bos_token_id},
        "recipe": policy.name,
        "cache": {"key_rope": policy.key_rope, "n_sink": policy.n_sink, "residual": policy.residual,
                  "layout": "B,H_kv,T,D", "smoothing": smoothing, "prefix": prefix_json},
        "layers": layers,
        "tensors": {name: {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "sha256": sha256_tensor(t)}
                    for name, t in sorted(tensors.items())},
        "tensor_file": {"name": TENSOR_FILE, "sha256": "0" * 64},
        "calibration": provenance,
        "evaluation": evaluation or {},
        "runtime_check": None,
    }
    return manifest, tensors


def expected_shapes(manifest: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor the manifest references, with the shape its fields imply."""
    m = manifest["model"]
    h, d, n_layers = m["n_kv_heads"], m["head_dim"], m["n_layers"]
    shapes: dict[str, tuple[int, ...]] = {}
    for layer in manifest["layers"]:
        for kind in ("key", "value"):
            p = layer[kind]
            for name, ref in p["tensors"].items():
                if name == "codebook":
                    shapes[ref] = (2 ** p["bits"],)
                elif name == "fp8_scale":
                    shapes[ref] = () if p["axis"] == "tensor" else (h,)
                else:
                    shapes[ref] = (h, d)
    cache = manifest["cache"]
    if cache["smoothing"]:
        shapes[cache["smoothing"]["tensor"]] = (n_layers, h, d)
    if cache["prefix"]:
        n = len(cache["prefix"]["token_ids"])
        for ref in cache["prefix"]["tensors"].values():
            shapes[ref] = (n_layers, h, n, d)
    return shapes


def check_tensors(manifest: dict, tensors: dict[str, torch.Tensor]) -> None:
    """Declared entries, implied shapes, dtypes and per-tensor sha256 all agree; nothing missing or extra."""
    declared = manifest["tensors"]
    implied = expected_shapes(manifest)
    for ref in implied:
        if ref not in declared:
            raise MissingTensorError(f"tensor {ref!r} is referenced by the manifest but not declared in 'tensors'")
    for ref, entry in declared.items():
        if ref not in implied:
            raise SchemaError(f"tensor {ref!r} is declared but no manifest field uses it")
        if ref not in tensors:
            raise MissingTensorError(f"tensor {ref!r} is missing from {TENSOR_FILE}")
        t = tensors[ref]
        want_shape = implied[ref]
        if tuple(entry["shape"]) != want_shape or tuple(t.shape) != want_shape:
            raise TensorShapeError(f"tensor {ref!r}: shape {tuple(t.shape)} (declared {tuple(entry['shape'])}); "
                                   f"the manifest fields imply {want_shape}")
        if t.dtype != DTYPES[entry["dtype"]]:
            raise TensorShapeError(f"tensor {ref!r}: dtype {t.dtype}, declared {entry['dtype']}")
        if sha256_tensor(t) != entry["sha256"]:
            raise ChecksumError(f"tensor {ref!r}: sha256 does not match the manifest")
    extra = sorted(set(tensors) - set(declared))
    if extra:
        raise SchemaError(f"{TENSOR_FILE} holds tensors the manifest does not declare: {extra[:5]}")


def check_model(manifest: dict, spec) -> None:
    m = manifest["model"]
    pairs = {"sha256": spec.model_sha256, "n_layers": spec.n_layers, "n_kv_heads": spec.n_kv_heads,
             "head_dim": spec.head_dim, "n_q_heads": spec.n_q_heads}
    for field, value in pairs.items():
        if m[field] != value:
            raise ModelMismatchError(f"artifact was calibrated for model {m['name']} with {field}={m[field]!r}; "
                                     f"the model given has {field}={value!r}")
    if manifest["tokenizer"]["sha256"] != spec.tokenizer_sha256:
        raise ModelMismatchError("artifact tokenizer sha256 differs from the given model's tokenizer")


def _policy_from_json(p: dict, tensors: dict[str, torch.Tensor], where: str) -> TensorPolicy:
    kw = {name: tensors[ref] for name, ref in p["tensors"].items()}
    tp = TensorPolicy(format=p["format"], bits=p["bits"], axis=p["axis"], group_size=p["group_size"],
                      outlier_fraction=p["outliers"]["fraction"], fp8_dtype=p.get("fp8_dtype", "e4m3"), **kw)
    try:
        tp.validate(where)
    except CodecError as exc:
        raise SchemaError(str(exc)) from None
    return tp


def policy_from_manifest(manifest: dict, tensors: dict[str, torch.Tensor]) -> CachePolicy:
    layers = manifest["layers"]
    if [layer["index"] for layer in layers] != list(range(manifest["model"]["n_layers"])):
        raise SchemaError(f"layers must list indices 0..{manifest['model']['n_layers'] - 1} in order")
    pairs = [(_policy_from_json(layer["key"], tensors, f"layers/{i}/key"),
              _policy_from_json(layer["value"], tensors, f"layers/{i}/value")) for i, layer in enumerate(layers)]
    cache = manifest["cache"]
    smooth = tensors[cache["smoothing"]["tensor"]] if cache["smoothing"] else None
    if smooth is not None and (not torch.isfinite(smooth).all() or (smooth <= 0).any()):
        raise SchemaError("smoothing tensor must be finite and positive")
    prefix = cache["prefix"]
    return CachePolicy(name=manifest["recipe"], layers=pairs, key_rope=cache["key_rope"], n_sink=cache["n_sink"],
                       residual=cache["residual"], smooth=smooth,
                       prefix_len=len(prefix["token_ids"]) if prefix else 0)
