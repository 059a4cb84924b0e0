"""FP8 KV-cache scales as a checkpoint vLLM serves as is (the llm-compressor / compressed-tensors convention).

A vLLM checkpoint folder (docs/vllm.md) is a Hugging Face model folder plus the calibrated scales:
- the model's weight shards (`*.safetensors`) and `model.safetensors.index.json`, whose `weight_map` names every
  weight AND every scale: vLLM loads only the files the index lists, so a scales file missing from it is dropped
  silently and vLLM's compressed-tensors KV method keeps its initial 1.0 scales;
- `kv_cache_scales.safetensors`: `model.layers.N.self_attn.k_scale` / `v_scale`, float32 shape [] (what
  vLLM 0.32's maybe_remap_kv_scale_name maps to `model.layers.N.self_attn.attn.k_scale`). scale = amax / 448
  (E4M3): the engine stores fp8(x / scale) and multiplies back. No q_scale: vLLM's CPU attention never quantizes
  queries, and no query statistics are calibrated (docs/vllm.md);
- `config.json` with `architectures` and `quantization_config = {quant_method: "compressed-tensors", format,
  config_groups: {}, ignore: [], quantization_status: "compressed", kv_cache_scheme: {num_bits: 8, type: "float",
  strategy: "tensor", symmetric: true, dynamic: false}}`;
- the tokenizer files, and `kvcalib/`: the native artifact (manifest.json + tensors.safetensors) the scales come
  from, with `kvcalib/checkpoint.json` listing every file of the folder with its sha256 and size
  (verify_checkpoint: each a regular file inside the folder, read as untrusted input).

Scales come from calibration, never defaults: an all-one scale set is refused (the silent-default failure).
Per-head scales (strategy attn_head) are written only by `kv_scale_tensors` for other consumers; the checkpoint
refuses them: vLLM 0.32 serves one float per layer on its CPU backend (the max over heads).

The folder has two kinds (`checkpoint_kind`): "fp8", above, which vLLM serves by itself; and "packed", for the
low-bit recipes the kvcalib vLLM plugin serves (exporters/vllm_slots.py: nuq codes, per-channel pre-RoPE keys,
sparse outliers, fp16 sink rows). A packed folder is the same folder without `quantization_config` in config.json
(vLLM would apply it) and without the scales file (nor an index entry naming it): the plugin reads the artifact
under kvcalib/.
"""
from __future__ import annotations

import os
import stat
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load as load_safetensors

from exporters import vllm_slots
from exporters.artifact import (MANIFEST_FILE, MAX_JSON_BYTES, file_kind, load_folder, open_folder, open_regular,
                                parse_json_object, read_inside, refuse_holes, relative_parts)
from exporters.checksums import sha256_file, sha256_stream
from exporters.manifest import ChecksumError, ManifestError

SCALES_FILE = "kv_cache_scales.safetensors"
INDEX_FILE = "model.safetensors.index.json"
ARTIFACT_DIR = "kvcalib"              # the native artifact inside a checkpoint folder
RECORD_FILE = "checkpoint.json"       # kvcalib/checkpoint.json: every file of the folder with its sha256
RECORD_FORMAT = "kvcalib-vllm-checkpoint"
MAX_SCALES_BYTES = 16 << 20           # kv_cache_scales.safetensors: 2 float32 per layer, under 200 KB for 1024 layers
STRATEGIES = {"tensor": "tensor", "head": "attn_head"}
SCALE_NAMES = ("k_scale", "v_scale")
MAX_REFUSALS = 4                    # refusal lines a message names before "..."


class CheckpointError(ManifestError):
    """A checkpoint folder that is incomplete, inconsistent with its artifact, or not servable as claimed."""


def is_checkpoint(directory: str | Path) -> bool:
    """A vLLM checkpoint folder: no manifest at its top, the artifact under kvcalib/."""
    d = Path(directory)
    return not (d / MANIFEST_FILE).exists() and (d / ARTIFACT_DIR / MANIFEST_FILE).is_file()


def scale_name(layer: int, which: str) -> str:
    return f"model.layers.{layer}.self_attn.{which}"


def kv_scale_tensors(k_scales: list[torch.Tensor], v_scales: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for i, (k, v) in enumerate(zip(k_scales, v_scales)):
        for name, s in (("k_scale", k), ("v_scale", v)):
            s = s.detach().float().reshape(-1) if s.dim() else s.detach().float().reshape(())
            if not torch.isfinite(s).all() or (s <= 0).any():
                raise ValueError(f"layer {i} {name}: scales must be finite and positive, got {s.tolist()}")
            out[scale_name(i, name)] = s.contiguous()
    if all(bool((t == 1).all()) for t in out.values()):
        raise ValueError("every k_scale / v_scale is 1.0: refusing to export uncalibrated default scales")
    return out


def quantization_config(axis: str) -> dict:
    if axis not in STRATEGIES:
        raise ValueError(f"fp8 scale axis must be one of {tuple(STRATEGIES)}, got {axis!r}")
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {}, "ignore": [],
            "quantization_status": "compressed",
            "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": STRATEGIES[axis], "symmetric": True,
                                "dynamic": False}}


def _unquantized_config(config: dict, architecture: str, tail: str) -> dict:
    """The model's config.json with `architectures` set and the save-time fields left out; a source already
    quantized (its own quantization_config) is refused: merging two schemes is not verified."""
    existing = config.get("quantization_config")
    if existing:
        raise CheckpointError(f"config.json quantization_config: the source model is already quantized "
                              f"(quant_method {existing.get('quant_method')!r}); {tail}")
    out = {k: v for k, v in config.items() if k not in ("_name_or_path", "transformers_version",
                                                        "quantization_config")}
    out["architectures"] = list(config.get("architectures") or [architecture])
    return out


def checkpoint_config(config: dict, architecture: str) -> dict:
    """The fp8 kind's config.json: the model's with the KV-cache quantization_config (per-tensor) and
    `architectures` set. A source already quantized (its own quantization_config) is refused: merging two schemes
    is not verified."""
    out = _unquantized_config(config, architecture, "the vLLM checkpoint adds the KV-cache scheme to an "
                                                    "unquantized model only")
    out["quantization_config"] = quantization_config("tensor")
    return out


def packed_config(config: dict, architecture: str) -> dict:
    """The packed kind's config.json: the model's with `architectures` set and no quantization_config (vLLM would
    apply one; the kvcalib plugin stores the cache itself). A source already quantized is refused, as for fp8."""
    return _unquantized_config(config, architecture, "the packed vLLM checkpoint serves an unquantized model only")


def tensor_names(path: Path) -> list[str]:
    """The tensor names a safetensors file holds (its header only)."""
    with safe_open(str(path), framework="pt") as f:
        return list(f.keys())


def weights_index(weight_map: dict[str, str], total_size: int) -> dict:
    """The packed kind's model.safetensors.index.json: the weights' weight_map as is. A source shard named like the
    scales file is refused (a packed folder holds none)."""
    if SCALES_FILE in set(weight_map.values()):
        raise CheckpointError(f"model.safetensors.index.json: a source shard is named {SCALES_FILE}")
    return {"metadata": {"total_size": int(total_size)}, "weight_map": dict(sorted(weight_map.items()))}


def merged_index(weight_map: dict[str, str], total_size: int, scales: dict[str, torch.Tensor]) -> dict:
    """model.safetensors.index.json for the weights plus the scales file. A weight named like a scale (a source
    checkpoint that carries its own KV scales) is refused rather than silently shadowed."""
    clash = sorted(set(weight_map) & set(scales))
    if clash:
        raise CheckpointError(f"model.safetensors.index.json: the source weights already hold KV-cache scales "
                              f"({clash[:3]}...); refusing to replace them")
    if SCALES_FILE in set(weight_map.values()):
        raise CheckpointError(f"model.safetensors.index.json: a source shard is named {SCALES_FILE}")
    extra = sum(t.numel() * t.element_size() for t in scales.values())
    merged = dict(weight_map) | {name: SCALES_FILE for name in scales}
    return {"metadata": {"total_size": int(total_size) + int(extra)}, "weight_map": dict(sorted(merged.items()))}


def _shortened(refusals: list[str]) -> str:
    return "; ".join(refusals[:MAX_REFUSALS]) + ("; ..." if len(refusals) > MAX_REFUSALS else "")


def fp8_refusals(policy) -> list[str]:
    """Why vLLM's own fp8 cache cannot serve this policy as an fp8 checkpoint, one line per field (empty: it can)."""
    refusals = []
    for field, got, ok in (("cache/key_rope", policy.key_rope, "post"), ("cache/n_sink", policy.n_sink, 0),
                           ("cache/residual", policy.residual, 0)):
        if got != ok:
            refusals.append(f"{field}: vLLM's cache allows {ok!r}, got {got!r}")
    if policy.smooth is not None:
        refusals.append("cache/smoothing: vLLM's cache takes no SmoothAttention scales; allowed null")
    if policy.prefix_ids is not None and policy.prefix_ids.numel():
        refusals.append("cache/prefix: vLLM's cache takes no prefix rows; allowed null")
    for i, (k, v) in enumerate(policy.layers):
        for kind, p in (("key", k), ("value", v)):
            where = f"layers/{i}/{kind}"
            if p.format != "fp8":
                refusals.append(f"{where}/format: vLLM's scaled cache is fp8; allowed 'fp8', got {p.format!r}")
            elif p.fp8_dtype != "e4m3":
                refusals.append(f"{where}/fp8_dtype: allowed 'e4m3' (kv_cache_dtype=fp8), got {p.fp8_dtype!r}")
            elif p.axis != "tensor":
                refusals.append(f"{where}/axis: allowed 'tensor' (vLLM 0.32's CPU attention reads one scale per "
                                f"layer), got {p.axis!r}")
    return refusals


def scales_of(policy) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The per-tensor fp8 scales of a policy vLLM can serve as a checkpoint, or CheckpointError naming the field:
    fp8 e4m3, one scale per tensor, post-RoPE keys, every row quantized (no sink, residual, smoothing or prefix:
    vLLM's cache has none of them)."""
    refusals = fp8_refusals(policy)
    if refusals:
        raise CheckpointError(f"recipe {policy.name!r} is not servable as a vLLM fp8 checkpoint: "
                              + _shortened(refusals))
    return [k.fp8_scale for k, _ in policy.layers], [v.fp8_scale for _, v in policy.layers]


def checkpoint_kind(policy) -> str:
    """The checkpoint folder a policy is served from: "fp8" when vLLM's own fp8 cache serves it (scales_of), else
    "packed" when the kvcalib vLLM plugin does (exporters/vllm_slots.py refusals empty), else CheckpointError naming
    the fields both refuse."""
    fp8 = fp8_refusals(policy)
    if not fp8:
        return "fp8"
    packed = vllm_slots.refusals(policy)
    if not packed:
        return "packed"
    raise CheckpointError(f"recipe {policy.name!r} is not servable by vLLM: as an fp8 checkpoint: {_shortened(fp8)}; "
                          f"by the kvcalib vLLM plugin: {_shortened(packed)}")


def file_record(directory: Path) -> dict:
    """kvcalib/checkpoint.json's content: {"format", "files": {relative path: sha256}, "sizes": {relative path:
    bytes}} for every file but the record (sizes: so that a reader refuses a changed file before hashing it)."""
    files = sorted(p for p in directory.rglob("*") if p.is_file() and p.relative_to(directory).as_posix()
                   != f"{ARTIFACT_DIR}/{RECORD_FILE}")
    rel = {p: p.relative_to(directory).as_posix() for p in files}
    return {"format": RECORD_FORMAT, "files": {rel[p]: sha256_file(p) for p in files},
            "sizes": {rel[p]: p.stat().st_size for p in files}}


def _shown(value, limit: int = 120) -> str:
    """An untrusted value for a message: its repr, cut to `limit` characters."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def read_record(dir_fd: int, where: str) -> dict[str, tuple[str, int | None]]:
    """kvcalib/checkpoint.json of the folder `dir_fd` -> {relative path: (sha256, size or None)}, refused
    (CheckpointError naming the field) unless it is a JSON object of RECORD_FORMAT whose every path stays inside the
    folder (exporters.artifact.relative_parts: checked on the text alone, before any file is looked up) with 64
    lowercase hex digits, and, when `sizes` is recorded (not in records written before it), a size >= 0 for each
    path. A record written before sizes were recorded has none: its files are hashed whole."""
    name = f"{ARTIFACT_DIR}/{RECORD_FILE}"
    raw = read_inside(dir_fd, name, MAX_JSON_BYTES, where, "a record lists one line per file of the folder")
    if raw is None:
        raise CheckpointError(f"no {name} in {where!r}: not a kvcalib vLLM checkpoint")
    record = parse_json_object(raw, name, CheckpointError)
    extra = sorted(set(record) - {"format", "files", "sizes"})
    if record.get("format") != RECORD_FORMAT or extra:
        raise CheckpointError(f"{name}: allowed members format ({RECORD_FORMAT!r}), files and sizes; got format "
                              f"{_shown(record.get('format'))}" + (f" and members {_shown(extra)}" if extra else ""))
    files, sizes = record.get("files"), record.get("sizes")
    if not isinstance(files, dict) or not files:
        raise CheckpointError(f"{name} files: allowed a non-empty object {{relative path: sha256}}, got "
                              f"{_shown(files)}")
    for rel, digest in files.items():  # every path first: none may leave the folder, whatever else is wrong
        relative_parts(rel, f"{name} files")
        if not isinstance(digest, str) or len(digest) != 64 or set(digest) - set("0123456789abcdef"):
            raise CheckpointError(f"{name} files[{_shown(rel)}]: allowed 64 lowercase hex digits (sha256), got "
                                  f"{_shown(digest)}")
    if sizes is not None and (not isinstance(sizes, dict) or set(sizes) != set(files)):
        raise CheckpointError(f"{name} sizes: allowed an object {{relative path: bytes}} with the paths of files, got "
                              f"{_shown(sizes)}")
    for rel, size in (sizes or {}).items():
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise CheckpointError(f"{name} sizes[{_shown(rel)}]: allowed an integer >= 0, got {_shown(size)}")
    return {rel: (digest, None if sizes is None else sizes[rel]) for rel, digest in files.items()}


def _verify_file(dir_fd: int, rel: str, digest: str, size: int | None, where: str, hash_files: bool) -> None:
    """One recorded file: a regular file inside the folder (exporters.artifact.open_regular: no symbolic link on the
    way, nothing but a regular file), its size as recorded and not sparse (both before a byte is hashed), then its
    sha256 (hash_files)."""
    fd = open_regular(dir_fd, rel, where)
    if fd is None:
        raise CheckpointError(f"{rel}: listed in {ARTIFACT_DIR}/{RECORD_FILE} but missing from {where!r}")
    try:
        st = os.fstat(fd)
        if size is not None and st.st_size != size:
            raise ChecksumError(f"{rel}: sha256 differs from {ARTIFACT_DIR}/{RECORD_FILE} (its size already does, "
                                f"found before hashing: {st.st_size} bytes, recorded {size})")
        refuse_holes(st, rel, where)
        if hash_files:
            with os.fdopen(os.dup(fd), "rb") as f:
                if sha256_stream(f) != digest:
                    raise ChecksumError(f"{rel}: sha256 differs from {ARTIFACT_DIR}/{RECORD_FILE}")
    finally:
        os.close(fd)


def _read_json(dir_fd: int, name: str, where: str) -> dict:
    raw = read_inside(dir_fd, name, MAX_JSON_BYTES, where, "a model folder's JSON files are far smaller")
    if raw is None:
        raise CheckpointError(f"{name}: missing from {where!r}")
    return parse_json_object(raw, name, CheckpointError)


def _exists(dir_fd: int, name: str) -> bool:
    try:
        os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True


def _scales(dir_fd: int, where: str) -> dict[str, torch.Tensor]:
    """kv_cache_scales.safetensors' tensors, read as any recorded file (inside, regular, bounded)."""
    raw = read_inside(dir_fd, SCALES_FILE, MAX_SCALES_BYTES, where, "one float per layer and K / V")
    if raw is None:
        raise CheckpointError(f"{SCALES_FILE}: missing from {where!r}")
    try:
        return load_safetensors(raw)
    except Exception as exc:  # noqa: BLE001 -- a file with the recorded checksum but unreadable: refuse
        raise CheckpointError(f"{SCALES_FILE} could not be read: {type(exc).__name__}") from None


def verify_checkpoint(directory: str | Path, spec=None, hash_files: bool = True):
    """A checkpoint folder -> its native Artifact, fully checked: the artifact strictly (exporters.artifact, from
    kvcalib/, a real folder of the checkpoint); every file of the folder against kvcalib/checkpoint.json (none
    missing, none changed, none added at the top level nor under a recorded subfolder such as kvcalib/:
    _refuse_unrecorded; each a regular file inside the folder, its size checked before it is hashed); config.json's
    `architectures`; then per kind (checkpoint_kind of the artifact's policy): fp8: config.json's
    quantization_config, the index listing every scale in the scales file, and the scales themselves equal to the
    artifact's; packed: no quantization_config in config.json, no scales file in the folder nor in the index. Every
    file is read through one descriptor of the folder, as untrusted input (read_inside). Raises CheckpointError /
    ChecksumError / another ManifestError naming what differs. hash_files=False: the files are checked present,
    regular and of their recorded size but not re-hashed (the writer, whose record was just hashed from those very
    files)."""
    directory = Path(directory)
    where = str(directory)
    dir_fd = open_folder(directory, where)
    if dir_fd is None:
        raise CheckpointError(f"no such folder {where!r}")
    try:
        try:
            mode = os.stat(ARTIFACT_DIR, dir_fd=dir_fd, follow_symlinks=False).st_mode
        except FileNotFoundError:
            mode = None
        if mode is not None and not stat.S_ISDIR(mode):
            raise CheckpointError(f"{where}: {ARTIFACT_DIR} is {file_kind(mode)}; allowed a folder inside the "
                                  f"checkpoint (no symbolic link)")
        artifact = load_folder(directory / ARTIFACT_DIR, spec)
        record = read_record(dir_fd, where)
        for rel, (digest, size) in record.items():
            _verify_file(dir_fd, rel, digest, size, where, hash_files)
        with os.scandir(dir_fd) as entries:  # anything at the top level but a folder: an engine might load it
            added = sorted(e.name for e in entries if not e.is_dir(follow_symlinks=False) and e.name not in record)
        if added:
            raise CheckpointError(f"files not in {ARTIFACT_DIR}/{RECORD_FILE}: {added[:10]} (a serving engine might "
                                  f"load them)")
        _refuse_unrecorded(dir_fd, record, where)
        return _verify_kind(dir_fd, where, artifact)
    finally:
        os.close(dir_fd)


def _open_subfolder(dir_fd: int, rel: str, where: str) -> int:
    """A descriptor of the folder `rel` inside the checkpoint, every component opened without following a symbolic
    link (O_NOFOLLOW | O_DIRECTORY): a link or anything but a folder on the way is a CheckpointError naming it."""
    at, opened = dir_fd, []
    try:
        for i, part in enumerate(rel.split("/")):
            try:
                at = os.open(part, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_DIRECTORY", 0)
                             | getattr(os, "O_CLOEXEC", 0), dir_fd=at)
            except OSError as exc:
                named = "/".join(rel.split("/")[: i + 1])
                raise CheckpointError(f"{where}: {named} cannot be opened as a folder inside the checkpoint "
                                      f"({exc.strerror}); allowed a folder (no symbolic link)") from None
            opened.append(at)
        return opened.pop()
    finally:
        for fd in opened:
            os.close(fd)


def _refuse_unrecorded(dir_fd: int, record: dict, where: str) -> None:
    """Nothing under a recorded subfolder (one holding a file the record lists: kvcalib/, and the folder of any
    listed file) that the record does not list: no file, and no folder but those its listed paths run through
    (kvcalib/checkpoint.json itself aside). The plugin reads kvcalib/ and an engine may read a listed file's
    folder as a whole, so a file added there (a second manifest, a stray safetensors) would be served unverified;
    refused naming it (a folder with a trailing '/'). The top level, which may hold folders of its own, is
    verify_checkpoint's."""
    listed = set(record) | {f"{ARTIFACT_DIR}/{RECORD_FILE}"}
    folders = {"/".join(rel.split("/")[:i]) for rel in listed for i in range(1, rel.count("/") + 1)}
    added = []
    for folder in sorted(folders):
        fd = _open_subfolder(dir_fd, folder, where)
        try:
            with os.scandir(fd) as entries:
                for e in entries:
                    rel, is_dir = f"{folder}/{e.name}", e.is_dir(follow_symlinks=False)
                    if not (rel in folders if is_dir else rel in listed):
                        added.append(rel + ("/" if is_dir else ""))
        finally:
            os.close(fd)
    if added:
        added.sort()
        raise CheckpointError(f"{ARTIFACT_DIR}/{RECORD_FILE} does not list {_shown(added[:10])}"
                              f"{' ...' if len(added) > 10 else ''} under its recorded folder(s) "
                              f"{_shown(sorted(folders))}: allowed only the files it lists there (re-export the "
                              f"checkpoint with `kvcalib export-vllm`, or remove them)")


def _verify_kind(dir_fd: int, where: str, artifact):
    """config.json, the index and (fp8) the scales file against the artifact's checkpoint kind: see
    verify_checkpoint."""
    kind = checkpoint_kind(artifact.policy)
    config = _read_json(dir_fd, "config.json", where)
    index = _read_json(dir_fd, INDEX_FILE, where)
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
        raise CheckpointError(f"{INDEX_FILE} weight_map: allowed an object {{weight name: file name}}, got "
                              f"{_shown(weight_map)}")
    if kind == "packed":
        if "quantization_config" in config:
            raise CheckpointError(f"config.json quantization_config: a packed checkpoint (recipe "
                                  f"{artifact.policy.name!r}, served by the kvcalib vLLM plugin) has none, got "
                                  f"{_shown(config['quantization_config'], 400)} (vLLM would apply it)")
        named = sorted(name for name, f in weight_map.items() if f == SCALES_FILE)
        present = _exists(dir_fd, SCALES_FILE)
        if present or named:
            raise CheckpointError(f"{SCALES_FILE}: a packed checkpoint holds no fp8 scales, got the file "
                                  f"{'present' if present else 'absent'} and {INDEX_FILE} entries {named[:3]}")
    elif config.get("quantization_config") != quantization_config("tensor"):
        raise CheckpointError(f"config.json quantization_config: expected {quantization_config('tensor')}, got "
                              f"{_shown(config.get('quantization_config'), 400)}")
    if not config.get("architectures"):
        raise CheckpointError("config.json architectures: missing (vLLM cannot choose a model class)")
    if kind == "packed":
        return artifact
    k_scales, v_scales = scales_of(artifact.policy)
    expected = kv_scale_tensors(k_scales, v_scales)
    stored = _scales(dir_fd, where)
    for name, want in expected.items():
        if weight_map.get(name) != SCALES_FILE:
            raise CheckpointError(f"{INDEX_FILE} weight_map[{name!r}]: expected {SCALES_FILE!r}, got "
                                  f"{_shown(weight_map.get(name))} (vLLM would keep its 1.0 default)")
        got = stored.get(name)
        if got is None or got.dtype != want.dtype or got.shape != want.shape or not torch.equal(got, want):
            raise CheckpointError(f"{SCALES_FILE} {name}: differs from the artifact's scale {want.tolist()}")
    return artifact
