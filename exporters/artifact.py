"""The native artifact folder read strictly: `<dir>/manifest.json` + `<dir>/tensors.safetensors` -> a fully checked
Artifact. exporters/native.py writes and updates the folder and loads either kind of folder (load_artifact);
exporters/compressed_tensors.py checks the copy a vLLM checkpoint carries under kvcalib/ through load_folder.

An artifact comes from anyone (its checksums are not a signature), so its files are read as untrusted input:
only regular files inside the folder (no symbolic link, FIFO, device or directory: open_regular), each bounded
before it is read -- manifest.json by MAX_MANIFEST_BYTES, tensors.safetensors by what the parsed manifest implies
(tensor_file_bound) -- and never a file with holes (a sparse file claims bytes it does not hold). Every refusal is
a ManifestError naming the file, what is allowed and what was found.
"""
from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import stat
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load as load_safetensors

from exporters.codec import CachePolicy
from exporters.errors import InputError
from exporters.manifest import (DTYPES, MAX_DEPTH, TENSOR_FILE, ChecksumError, ManifestError, SchemaError,
                                check_binding, check_model, check_tensors, implied_tensors, nested_too_deep,
                                parse_manifest, policy_from_manifest)

MANIFEST_FILE = "manifest.json"
# manifest.json is refused above this size before it is read. Measured: the embedded SmolLM2-135M's manifest (30
# layers, a 4-bit recipe with outliers, evaluation, runtime check) is 48 KB, about 1.2 KB per layer and its
# tensors; the schema's largest (1024 layers, five tensors per key and value, a 4096-token prefix) is about 4 MB.
MAX_MANIFEST_BYTES = 16 << 20
# the other JSON files of a folder (a vLLM checkpoint's config.json, model.safetensors.index.json and
# kvcalib/checkpoint.json; a model folder's config.json): an index holds a line of ~100 bytes per weight, so this
# holds over half a million weights (the largest MoE checkpoints list about 100k)
MAX_JSON_BYTES = 64 << 20
# tensors.safetensors beyond its data: the 8-byte length and the JSON header, at most this per tensor (name, dtype,
# shape, offsets: ~100 bytes) plus the __metadata__ copy of the bound fields (at most twice manifest.json's size:
# JSON escapes each quote and backslash again inside a string) plus this slack (alignment padding, "format")
HEADER_BYTES_PER_TENSOR = 1024
HEADER_SLACK = 64 << 10
# a file larger than this whose allocated blocks hold less than half its size is refused as sparse: its holes
# read as zeros without end (a 100 GB file in 4 KB of disk); files written whole hold all their bytes
SPARSE_MIN_BYTES = 1 << 20


class FileKindError(ManifestError):
    """A file of the folder that is not a regular file inside it: a symbolic link, FIFO, device, socket or directory,
    a path leaving the folder, or a file that cannot be opened."""


class FileSizeError(ManifestError):
    """A file of the folder larger than its bound allows, sparse (holes), or changing while it is read."""


@dataclass
class Artifact:
    path: Path | None
    manifest: dict
    tensors: dict[str, torch.Tensor]
    policy: CachePolicy


# ---- untrusted files: regular files inside one folder, bounded before they are read -----------------------

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))
ALLOWED_FILE = "a regular file inside the folder (no symbolic link, FIFO, device or directory)"


def file_kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def relative_parts(rel: str, where: str) -> list[str]:
    """A path recorded in a folder's file (relative, '/'-separated) -> its components, refused (FileKindError) when
    it could leave the folder or name it ambiguously: absolute, '..', '.', empty components, NUL or backslash.
    Lexical only: nothing is looked up, so a refusal says nothing about the file system outside."""
    if not isinstance(rel, str) or not rel:
        raise FileKindError(f"{where}: a path must be a non-empty string relative to the folder, got {rel!r}")
    parts = rel.split("/")
    bad = rel.startswith("/") or "\\" in rel or "\x00" in rel or any(p in ("", ".", "..") for p in parts)
    if bad:
        raise FileKindError(f"{where}: {rel!r} leaves the folder or is ambiguous; allowed a relative path inside it "
                            f"('a/b', no leading '/', no '.', '..', empty component, backslash or NUL)")
    return parts


def _refuse_kind(mode: int, shown: str, where: str, want_dir: bool = False) -> None:
    ok = stat.S_ISDIR(mode) if want_dir else stat.S_ISREG(mode)
    if not ok:
        allowed = "a folder inside the folder (no symbolic link)" if want_dir else ALLOWED_FILE
        raise FileKindError(f"{where}: {shown} is {file_kind(mode)}; allowed {allowed}")


def open_regular(dir_fd: int, rel: str, where: str) -> int | None:
    """A descriptor of the regular file at `rel` under the folder `dir_fd`, or None when it is absent. Every component
    is looked up without following a symbolic link (lstat first, so a device or FIFO is never opened; then opened
    O_NOFOLLOW | O_NONBLOCK and fstat'ed, so a swap in between is seen too); anything but directories on the way and
    a regular file at the end is a FileKindError naming it and what it is."""
    parts = relative_parts(rel, where)
    opened: list[int] = []
    at = dir_fd
    try:
        for i, part in enumerate(parts):
            last, shown = i == len(parts) - 1, "/".join(parts[: i + 1])
            try:
                _refuse_kind(os.stat(part, dir_fd=at, follow_symlinks=False).st_mode, shown, where, not last)
                flags = os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
                flags |= (os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0)) if last else getattr(os, "O_DIRECTORY", 0)
                fd = os.open(part, flags, dir_fd=at)
            except FileNotFoundError:
                return None
            except OSError as exc:
                what = "a symbolic link" if exc.errno == errno.ELOOP else f"not readable ({exc.strerror})"
                raise FileKindError(f"{where}: {shown} is {what}; allowed {ALLOWED_FILE}") from None
            opened.append(fd)
            _refuse_kind(os.fstat(fd).st_mode, shown, where, not last)
            at = fd
        return opened.pop()
    finally:
        for fd in opened:
            os.close(fd)


def refuse_holes(st: os.stat_result, shown: str, where: str) -> None:
    """A sparse file (more than half of it holes) is refused before anything reads or hashes it: its holes read as
    zeros, so a few KB of disk claim any size. A file written whole holds all its bytes on disk."""
    allocated = getattr(st, "st_blocks", None)
    if allocated is not None and st.st_size > SPARSE_MIN_BYTES and 2 * 512 * allocated < st.st_size:
        raise FileSizeError(f"{where}: {shown} is {st.st_size} bytes but holds {512 * allocated} on disk (a sparse "
                            f"file); allowed a file written whole (copy it with `cp --sparse=never`)")


def read_regular(fd: int, limit: int, shown: str, where: str, why: str) -> bytes:
    """The whole content of an open regular file, refused (FileSizeError) before any byte is read when it is larger
    than `limit` (`why` says where the bound comes from) or sparse, and when it changes while it is read."""
    st = os.fstat(fd)
    if st.st_size > limit:
        raise FileSizeError(f"{where}: {shown} is {st.st_size} bytes; allowed at most {limit} ({why})")
    refuse_holes(st, shown, where)
    with os.fdopen(os.dup(fd), "rb") as f:
        data = f.read(st.st_size)
        grew = f.read(1)
    if len(data) != st.st_size or grew:
        raise FileSizeError(f"{where}: {shown} changed while it was read ({st.st_size} bytes at first)")
    return data


def open_folder(directory: Path, where: str) -> int | None:
    """A descriptor of the folder (None: it does not exist); the folder itself may be reached through a link."""
    try:
        return os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0))
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        raise FileKindError(f"{where}: the folder cannot be opened ({exc.strerror})") from None


def read_inside(dir_fd: int, rel: str, limit: int, where: str, why: str) -> bytes | None:
    """The bytes of the regular file `rel` inside the folder (None: absent), bounded by `limit`: open_regular,
    then read_regular."""
    fd = open_regular(dir_fd, rel, where)
    if fd is None:
        return None
    try:
        return read_regular(fd, limit, rel, where, why)
    finally:
        os.close(fd)


def read_in_folder(directory: str | Path, rel: str, limit: int, where: str, why: str) -> bytes | None:
    """The bytes of the regular file `rel` inside `directory` (None: the folder or the file is absent): open_folder,
    then read_inside, the folder's descriptor closed whatever happens."""
    dir_fd = open_folder(Path(directory), where)
    if dir_fd is None:
        return None
    try:
        return read_inside(dir_fd, rel, limit, where, why)
    finally:
        os.close(dir_fd)


def parse_json_object(raw: bytes, where: str, error: type[InputError] = SchemaError) -> dict:
    """A side JSON file of a folder (a checkpoint's config.json, index, record; a model folder's config.json) -> a
    dict, refused (`error`, naming `where`) unless it is UTF-8 JSON holding an object nested at most MAX_DEPTH deep
    (as a manifest: the readers after it recurse). Python refuses integers of more than 4300 digits with a plain
    ValueError: refused here too."""
    try:
        value = json.loads(raw.decode("utf-8"))
    except RecursionError:
        raise error(f"{where}: nests objects and arrays deeper than Python reads; allowed at most {MAX_DEPTH} "
                    f"levels") from None
    except (UnicodeDecodeError, ValueError) as exc:  # JSONDecodeError is a ValueError
        raise error(f"{where}: not valid UTF-8 JSON ({type(exc).__name__}: {str(exc)[:200]})") from None
    if not isinstance(value, dict):
        raise error(f"{where}: allowed a JSON object, got {type(value).__name__}")
    deep = nested_too_deep(value)
    if deep is not None:
        raise error(f"{where}: {deep} nests objects and arrays deeper than {MAX_DEPTH} levels; allowed at most "
                    f"{MAX_DEPTH}")
    return value


# ---- the artifact: manifest, then the tensor file bounded by it ---------------------------------------------

def tensor_file_metadata(raw: bytes) -> dict[str, str]:
    """The `__metadata__` of a safetensors file: 8-byte little-endian header length, then the JSON header."""
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    return header.get("__metadata__") or {}


def tensor_file_bound(manifest: dict, manifest_bytes: int) -> int:
    """The most bytes tensors.safetensors of a parsed manifest may hold: the tensors its fields imply
    (exporters.manifest.implied_tensors, shape x dtype size: what check_tensors later requires of every declared
    tensor), the 8-byte header length, and the JSON header (HEADER_BYTES_PER_TENSOR per tensor, the bound fields'
    copy at most twice the manifest's size, HEADER_SLACK)."""
    implied = implied_tensors(manifest)
    data = sum(math.prod(shape) * DTYPES[dtype].itemsize for shape, dtype in implied.values())
    return 8 + data + HEADER_BYTES_PER_TENSOR * len(implied) + 2 * manifest_bytes + HEADER_SLACK


def parse_manifest_bytes(raw: bytes) -> dict:
    """manifest.json's bytes -> the checked manifest (exporters.manifest.parse_manifest), refused first when they
    exceed MAX_MANIFEST_BYTES (a caller handing bytes it did not read through read_regular)."""
    if len(raw) > MAX_MANIFEST_BYTES:
        raise FileSizeError(f"{MANIFEST_FILE} is {len(raw)} bytes; allowed at most {MAX_MANIFEST_BYTES}")
    return parse_manifest(raw)


def _tensor_bound(manifest: dict, manifest_bytes: int) -> int:
    try:
        return tensor_file_bound(manifest, manifest_bytes)
    except (KeyError, TypeError, IndexError) as exc:
        raise SchemaError(f"manifest is inconsistent: {type(exc).__name__}: {exc}") from None


def _checked(manifest: dict, raw_manifest_len: int, raw_tensors: bytes | None, spec, path: Path | None) -> Artifact:
    """A parsed manifest and the tensor file's bytes -> the Artifact: see parse_artifact."""
    if raw_tensors is None:
        raise ManifestError(f"missing {TENSOR_FILE} in {str(path)!r}")
    bound = _tensor_bound(manifest, raw_manifest_len)
    if len(raw_tensors) > bound:
        raise FileSizeError(f"{TENSOR_FILE} is {len(raw_tensors)} bytes; allowed at most {bound} (what the "
                            f"manifest's tensors imply, with their header)")
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


def parse_artifact(raw_manifest: bytes, raw_tensors: bytes | None, spec=None, path: Path | None = None) -> Artifact:
    """Both files' bytes -> a fully checked Artifact: the manifest (size, digest, schema, cross-checks), the tensor
    file's size (tensor_file_bound) and sha256, the decoding fields against the file's header, every tensor's
    shape / dtype / sha256 / values, the policy, and (given a ModelSpec) the served model. Raises a ManifestError
    subclass per cause."""
    return _checked(parse_manifest_bytes(raw_manifest), len(raw_manifest), raw_tensors, spec, path)


def _still_there(directory: Path, dir_fd: int) -> bool:
    try:
        now, opened = os.stat(directory), os.fstat(dir_fd)
    except FileNotFoundError:
        return False
    return (now.st_dev, now.st_ino) == (opened.st_dev, opened.st_ino)


def read_folder(directory: Path, attempts: int = 10) -> tuple[bytes, dict, bytes | None]:
    """(manifest.json's bytes, the checked manifest, tensors.safetensors' bytes or None when absent) of one version
    of the folder. Both files are opened through one descriptor of the folder, so a concurrent overwrite (which
    swaps whole folders) never pairs a manifest with another version's tensors; a version deleted while it was read
    is read again. Each file only if it is a regular file inside the folder, manifest.json within
    MAX_MANIFEST_BYTES, then tensors.safetensors within what that manifest implies (tensor_file_bound), so a FIFO,
    a link to /dev/zero or a sparse 100 GB file is refused before a byte of it is read."""
    where = str(directory)
    for attempt in range(attempts):
        dir_fd = open_folder(directory, where)
        if dir_fd is None:
            break
        try:
            raw_manifest = read_inside(dir_fd, MANIFEST_FILE, MAX_MANIFEST_BYTES, where,
                                       "a manifest of the schema's largest model is about 4 MB")
            if raw_manifest is None:
                if _still_there(directory, dir_fd):
                    break
                continue
            manifest = parse_manifest_bytes(raw_manifest)
            bound = _tensor_bound(manifest, len(raw_manifest))
            raw_tensors = read_inside(dir_fd, TENSOR_FILE, bound, where,
                                      "what the manifest's tensors imply, with their header")
            if raw_tensors is not None or _still_there(directory, dir_fd) or attempt == attempts - 1:
                return raw_manifest, manifest, raw_tensors
        finally:
            os.close(dir_fd)
    raise ManifestError(f"no {MANIFEST_FILE} in {where!r}: not an artifact folder")


def read_manifest(directory: str | Path) -> dict:
    """The checked manifest alone (digest, schema, cross-checks): the tensor file is not read. manifest.json is
    read as read_folder reads it (a regular file inside the folder, at most MAX_MANIFEST_BYTES)."""
    where = str(directory)
    raw = read_in_folder(directory, MANIFEST_FILE, MAX_MANIFEST_BYTES, where,
                         "a manifest of the schema's largest model is about 4 MB")
    if raw is None:
        raise ManifestError(f"no {MANIFEST_FILE} in {where!r}: not an artifact folder")
    return parse_manifest_bytes(raw)


def load_folder(directory: str | Path, spec=None) -> Artifact:
    """A plain artifact folder, strictly (see parse_artifact): both files of one version of the folder (read_folder)."""
    directory = Path(directory)
    raw_manifest, manifest, raw_tensors = read_folder(directory)
    return _checked(manifest, len(raw_manifest), raw_tensors, spec, directory)
