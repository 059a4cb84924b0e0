"""The native artifact folder read strictly: `<dir>/manifest.json` + `<dir>/tensors.safetensors` -> a fully checked
Artifact. exporters/native.py writes and updates the folder and loads either kind of folder (load_artifact);
exporters/compressed_tensors.py checks the copy a vLLM checkpoint carries under kvcalib/ through load_folder."""
from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load as load_safetensors

from exporters.codec import CachePolicy
from exporters.manifest import (TENSOR_FILE, ChecksumError, ManifestError, SchemaError, check_binding, check_model,
                                check_tensors, parse_manifest, policy_from_manifest)

MANIFEST_FILE = "manifest.json"


@dataclass
class Artifact:
    path: Path | None
    manifest: dict
    tensors: dict[str, torch.Tensor]
    policy: CachePolicy



def tensor_file_metadata(raw: bytes) -> dict[str, str]:
    """The `__metadata__` of a safetensors file: 8-byte little-endian header length, then the JSON header."""
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    return header.get("__metadata__") or {}


def parse_artifact(raw_manifest: bytes, raw_tensors: bytes | None, spec=None, path: Path | None = None) -> Artifact:
    """Both files' bytes -> a fully checked Artifact: the manifest (digest, schema, cross-checks), the tensor
    file's sha256, the decoding fields against the file's header, every tensor's shape / dtype / sha256, the
    policy, and (given a ModelSpec) the served model. Raises a ManifestError subclass per cause."""
    manifest = parse_manifest(raw_manifest)
    if raw_tensors is None:
        raise ManifestError(f"missing {TENSOR_FILE} in {str(path)!r}")
    if hashlib.sha256(raw_tensors).hexdigest() != manifest["tensor_file"]["sha256"]:
        raise ChecksumError(f"{TENSOR_FILE} sha256 does not match the manifest")
    try:
        metadata, tensors = tensor_file_metadata(raw_tensors), load_safetensors(raw_tensors)
    except Exception as exc:  # a file with the right checksum but unreadable: refuse, never guess
        raise ChecksumError(f"{TENSOR_FILE} could not be read: {type(exc).__name__}") from None
    try:
        check_binding(manifest, metadata)
        check_tensors(manifest, tensors)
        policy = policy_from_manifest(manifest, tensors)
    except (KeyError, TypeError, IndexError) as exc:
        raise SchemaError(f"manifest is inconsistent: {type(exc).__name__}: {exc}") from None
    if spec is not None:
        check_model(manifest, spec)
    return Artifact(path, manifest, tensors, policy)



def _read_at(dir_fd: int, name: str) -> bytes | None:
    try:
        fd = os.open(name, os.O_RDONLY, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    with os.fdopen(fd, "rb") as f:
        return f.read()


def _still_there(directory: Path, dir_fd: int) -> bool:
    try:
        now, opened = os.stat(directory), os.fstat(dir_fd)
    except FileNotFoundError:
        return False
    return (now.st_dev, now.st_ino) == (opened.st_dev, opened.st_ino)


def read_files(directory: Path, attempts: int = 10) -> tuple[bytes | None, bytes | None]:
    """(manifest.json, tensors.safetensors) bytes of one version of the folder (None: absent). Both files are
    opened through one descriptor of the folder, so a concurrent overwrite (which swaps whole folders) never
    pairs a manifest with another version's tensors; a version deleted while it was read is read again."""
    files: tuple[bytes | None, bytes | None] = (None, None)
    for _ in range(attempts):
        try:
            dir_fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        except (FileNotFoundError, NotADirectoryError):
            return None, None
        try:
            files = _read_at(dir_fd, MANIFEST_FILE), _read_at(dir_fd, TENSOR_FILE)
            if None not in files or _still_there(directory, dir_fd):
                return files
        finally:
            os.close(dir_fd)
    return files


def read_manifest(directory: str | Path) -> dict:
    """The checked manifest alone (digest, schema, cross-checks): the tensor file is not read."""
    path = Path(directory) / MANIFEST_FILE
    if not path.is_file():
        raise ManifestError(f"no {MANIFEST_FILE} in {str(directory)!r}: not an artifact folder")
    return parse_manifest(path.read_bytes())


def load_folder(directory: str | Path, spec=None) -> Artifact:
    """A plain artifact folder, strictly (see parse_artifact): both files of one version of the folder."""
    directory = Path(directory)
    raw_manifest, raw_tensors = read_files(directory)
    if raw_manifest is None:
        raise ManifestError(f"no {MANIFEST_FILE} in {str(directory)!r}: not an artifact folder")
    return parse_artifact(raw_manifest, raw_tensors, spec, directory)
