"""The native artifact: `<dir>/manifest.json` + `<dir>/tensors.safetensors`, written atomically, loaded strictly."""
from __future__ import annotations

import json
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from exporters.codec import CachePolicy
from exporters.manifest import (TENSOR_FILE, ChecksumError, ManifestError, SchemaError, check_model, check_tensors,
                                policy_from_manifest, validate_schema)
from exporters.checksums import sha256_file

MANIFEST_FILE = "manifest.json"


@dataclass
class Artifact:
    path: Path
    manifest: dict
    tensors: dict[str, torch.Tensor]
    policy: CachePolicy


class ArtifactExistsError(ManifestError):
    pass


def write_artifact(directory: str | Path, manifest: dict, tensors: dict[str, torch.Tensor], overwrite: bool = False) -> Path:
    """Write into a temporary sibling folder, validate, then rename into place. Never half-written."""
    final = Path(directory)
    if final.exists() and not overwrite:
        raise ArtifactExistsError(f"artifact folder {str(final)!r} already exists; pass overwrite=True "
                                  f"(export.overwrite=true) to replace it")
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".{final.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / TENSOR_FILE))
        manifest = json.loads(json.dumps(manifest))  # a JSON-clean copy: what the loader will read
        manifest["tensor_file"]["sha256"] = sha256_file(tmp / TENSOR_FILE)
        validate_schema(manifest)
        check_tensors(manifest, tensors)
        policy_from_manifest(manifest, tensors)
        (tmp / MANIFEST_FILE).write_text(json.dumps(manifest, indent=1))
        if final.exists():
            old = final.parent / f".{final.name}.old-{uuid.uuid4().hex[:8]}"
            os.rename(final, old)
            os.rename(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def read_manifest(directory: str | Path) -> dict:
    path = Path(directory) / MANIFEST_FILE
    if not path.is_file():
        raise ManifestError(f"no {MANIFEST_FILE} in {str(directory)!r}: not an artifact folder")
    try:
        manifest = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SchemaError(f"{MANIFEST_FILE} is not valid JSON: {exc}") from None
    validate_schema(manifest)
    return manifest


def load_artifact(directory: str | Path, spec=None) -> Artifact:
    """Strict: schema, file checksum, every tensor's shape / dtype / checksum, and (given a ModelSpec) the model
    identity. Raises a ManifestError subclass per cause; returns only a fully checked artifact."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    tensor_path = directory / TENSOR_FILE
    if not tensor_path.is_file():
        raise ManifestError(f"missing {TENSOR_FILE} in {str(directory)!r}")
    if sha256_file(tensor_path) != manifest["tensor_file"]["sha256"]:
        raise ChecksumError(f"{TENSOR_FILE} sha256 does not match the manifest")
    try:
        tensors = load_file(str(tensor_path))
    except Exception as exc:  # a file with the right checksum but unreadable: refuse, never guess
        raise ChecksumError(f"{TENSOR_FILE} could not be read: {type(exc).__name__}") from None
    try:
        check_tensors(manifest, tensors)
        policy = policy_from_manifest(manifest, tensors)
    except (KeyError, TypeError, IndexError) as exc:
        raise SchemaError(f"manifest is inconsistent: {type(exc).__name__}: {exc}") from None
    if spec is not None:
        check_model(manifest, spec)
    return Artifact(directory, manifest, tensors, policy)


def update_manifest(directory: str | Path, **fields) -> dict:
    """Replace top-level fields (e.g. runtime_check) atomically; the tensor file is untouched."""
    manifest = read_manifest(directory)
    manifest.update(json.loads(json.dumps(fields)))
    validate_schema(manifest)
    path = Path(directory) / MANIFEST_FILE
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(manifest, indent=1))
    tmp.replace(path)
    return manifest
