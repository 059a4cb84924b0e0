"""The native artifact: `<dir>/manifest.json` + `<dir>/tensors.safetensors`, written atomically, updated, and loaded
strictly (exporters/artifact.py reads a plain folder; load_artifact also takes a vLLM checkpoint folder)."""
from __future__ import annotations

import ctypes
import errno
import hashlib
import json
import os
import shutil
import sys
import uuid
from pathlib import Path

import torch
from safetensors.torch import save

from exporters.artifact import MANIFEST_FILE, Artifact, load_folder, parse_artifact, read_manifest
from exporters.compressed_tensors import is_checkpoint, verify_checkpoint
from exporters.files import write_synced
from exporters.manifest import (DIGEST_FIELD, TENSOR_FILE, UNSIGNED, UPDATABLE, ManifestError, SchemaError,
                                bound_metadata, parse_manifest, serialize_manifest, validate_schema)

RENAME_EXCHANGE, AT_FDCWD = 2, -100   # linux/fs.h, fcntl.h


class ArtifactExistsError(ManifestError):
    pass


def _exchange(a: Path, b: Path) -> bool:
    """Swap two existing paths in one step (Linux renameat2 RENAME_EXCHANGE). False where the call is
    unavailable (no such libc function, ENOSYS, or EINVAL from a file system without the flag)."""
    fn = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None) if sys.platform == "linux" else None
    if fn is None:
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if fn(AT_FDCWD, os.fsencode(a), AT_FDCWD, os.fsencode(b), RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL):
        return False
    raise OSError(err, os.strerror(err), str(b))


def write_artifact(directory: str | Path, manifest: dict, tensors: dict[str, torch.Tensor], overwrite: bool = False) -> Path:
    """Write both files into a temporary sibling folder (fsynced), check them with the loader's own checks
    (parse_artifact), then put the folder in place. Never half-written: a new folder is renamed into place;
    with overwrite, the new and the old folder are swapped in one renameat2(RENAME_EXCHANGE), so a reader always
    finds a complete artifact, old or new, and the old one is deleted after. Where that call is unavailable
    (not Linux, ENOSYS, EINVAL) the old folder is renamed away and the new one renamed in: two renames, between
    which the folder is briefly absent."""
    final = Path(directory)
    if final.exists() and not overwrite:
        raise ArtifactExistsError(f"artifact folder {str(final)!r} already exists; pass overwrite=True "
                                  f"(export.overwrite=true) to replace it")
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".{final.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        manifest = json.loads(json.dumps({**manifest, DIGEST_FIELD: UNSIGNED}))  # JSON-clean: what is read back
        validate_schema(manifest)  # before its fields are copied into the tensor file's header
        raw_tensors = save({k: v.contiguous() for k, v in tensors.items()}, metadata=bound_metadata(manifest))
        manifest["tensor_file"]["sha256"] = hashlib.sha256(raw_tensors).hexdigest()
        raw_manifest = serialize_manifest(manifest)
        parse_artifact(raw_manifest, raw_tensors)
        write_synced(tmp / TENSOR_FILE, raw_tensors)
        write_synced(tmp / MANIFEST_FILE, raw_manifest)
        install_folder(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def install_folder(tmp: Path, final: Path) -> None:
    """Put a complete temporary sibling folder in place of `final`: renamed in when `final` is new; otherwise the
    two swapped in one renameat2(RENAME_EXCHANGE) and the old one deleted, or (no such call) the old one renamed
    away first. A reader finds the old or the new folder, never a mix."""
    if not final.exists():
        os.rename(tmp, final)
    elif _exchange(tmp, final):
        shutil.rmtree(tmp, ignore_errors=True)  # tmp now holds the old folder
    else:
        old = final.parent / f".{final.name}.old-{uuid.uuid4().hex[:8]}"
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)


def load_artifact(directory: str | Path, spec=None) -> Artifact:
    """Strict: see exporters.artifact.parse_artifact. Returns only a fully checked artifact. A vLLM checkpoint folder
    (exporters/compressed_tensors.py: the artifact under kvcalib/) is checked whole by verify_checkpoint."""
    if is_checkpoint(directory):
        return verify_checkpoint(directory, spec)
    return load_folder(directory, spec)


def update_manifest(directory: str | Path, **fields) -> dict:
    """Replace informative top-level fields (UPDATABLE: evaluation, runtime_check, gate) and re-sign the digest;
    the tensor file is untouched. The new manifest goes to a uniquely named temporary file in the same folder,
    fsynced, then os.replace'd over manifest.json: readers see the old or the new file, and concurrent writers
    never share a temporary file (the last replace wins; each writer's own read-modify-write is not merged)."""
    refused = sorted(set(fields) - set(UPDATABLE))
    if refused:
        raise SchemaError(f"update_manifest may replace only {list(UPDATABLE)}, got {refused}")
    manifest = read_manifest(directory)
    manifest.update(json.loads(json.dumps(fields)))
    raw = serialize_manifest(manifest)
    manifest = parse_manifest(raw)
    path = Path(directory) / MANIFEST_FILE
    tmp = path.parent / f".{MANIFEST_FILE}.{uuid.uuid4().hex}.tmp"
    try:
        write_synced(tmp, raw)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return manifest
