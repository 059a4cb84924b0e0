"""An artifact folder from a stranger (issue 51, items 3 and 4): only regular files inside the folder are read, each
bounded before it is read (exporters/artifact.py), and a vLLM checkpoint's record never names a path outside its
folder (exporters/compressed_tensors.py verify_checkpoint). A hang would stop the suite, so the cases that hung or
exhausted memory run under a timeout: signal.alarm in this process, or a subprocess with a timeout and an
address-space limit (reading /dev/zero whole would otherwise take the machine's memory)."""
import hashlib
import json
import os
import re
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.manifest_mutations import deadline  # SIGALRM: a blocked open() of a FIFO fails instead of hanging
from exporters import compressed_tensors as ct
from exporters.artifact import (MANIFEST_FILE, MAX_MANIFEST_BYTES, FileKindError, FileSizeError, read_manifest,
                                tensor_file_bound)
from exporters.manifest import TENSOR_FILE, ChecksumError, ManifestError, serialize_manifest
from exporters.native import load_artifact

ROOT = Path(__file__).resolve().parents[2]
SPARSE = 100 << 30   # a sparse file's apparent size: 100 GB in no disk at all
LIMIT_S = 10         # "within seconds": every refusal below takes milliseconds once the process runs


def load_in_subprocess(path: Path) -> tuple[str, float]:
    """load_artifact(path) in a child process limited to 2 GiB of address space and LIMIT_S + start-up seconds ->
    (its refusal "ErrorClass: message", or "accepted"; seconds). A child that hangs or runs out of memory fails."""
    code = ("import sys\nfrom exporters.errors import InputError\nfrom exporters.native import load_artifact\n"
            "try:\n    load_artifact(sys.argv[1])\nexcept InputError as exc:\n"
            "    print(f'{type(exc).__name__}: {exc}')\nelse:\n    print('accepted')\n")

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))

    start = time.monotonic()
    out = subprocess.run([sys.executable, "-c", code, str(path)], cwd=ROOT, capture_output=True, text=True,
                         timeout=LIMIT_S + 30, preexec_fn=limit, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip(), time.monotonic() - start


def sparse_file(path: Path, size: int = SPARSE) -> None:
    with open(path, "wb") as f:
        f.truncate(size)


@pytest.fixture
def artifact(make_artifact):
    return make_artifact("kvquant-4b-1pct")


# ---- the artifact's own two files ---------------------------------------------------------------------------

@pytest.mark.parametrize("name", [MANIFEST_FILE, TENSOR_FILE])
def test_a_fifo_is_refused_without_blocking(artifact, name):
    """Before: open() of a FIFO named manifest.json or tensors.safetensors blocked `show` forever."""
    (artifact / name).unlink()
    os.mkfifo(artifact / name)
    with deadline(), pytest.raises(FileKindError, match=rf"{name} is a FIFO \(named pipe\); allowed a regular file"):
        load_artifact(artifact)


@pytest.mark.parametrize("name,target", [(TENSOR_FILE, "/dev/zero"), (MANIFEST_FILE, "/dev/zero"),
                                         (TENSOR_FILE, "sparse"), (MANIFEST_FILE, "sparse")])
def test_dev_zero_and_sparse_files_are_refused_before_they_are_read(artifact, tmp_path, name, target):
    """Before: a link to /dev/zero was read until memory ran out, a sparse 100 GB file read whole (MemoryError, a
    crash). Now: a link is refused unopened; a sparse file by its size, against MAX_MANIFEST_BYTES or against what
    the manifest's tensors imply, before one byte is read."""
    (artifact / name).unlink()
    if target == "sparse":
        sparse_file(artifact / name)
        want = rf"FileSizeError: .*{name} is {SPARSE} bytes; allowed at most \d+"
    else:
        os.symlink(target, artifact / name)
        want = rf"FileKindError: .*{name} is a symbolic link; allowed a regular file inside the folder"
    refusal, seconds = load_in_subprocess(artifact)
    assert re.match(want, refusal), refusal
    assert seconds < LIMIT_S + 20


def test_manifest_json_as_a_directory_is_refused(artifact):
    """Before: IsADirectoryError, an internal error (exit 5)."""
    (artifact / MANIFEST_FILE).unlink()
    (artifact / MANIFEST_FILE).mkdir()
    for read in (load_artifact, read_manifest):
        with pytest.raises(FileKindError, match="manifest.json is a directory; allowed a regular file inside"):
            read(artifact)


def test_a_tensor_file_linked_outside_the_folder_is_refused(artifact, tmp_path):
    """Before: the link was followed and the artifact loaded from a file outside its folder. The same link to a FIFO
    shows that nothing is opened through it (opening a FIFO would block)."""
    outside = tmp_path / "elsewhere.safetensors"
    (artifact / TENSOR_FILE).rename(outside)
    os.symlink(outside, artifact / TENSOR_FILE)
    with pytest.raises(FileKindError, match="tensors.safetensors is a symbolic link"):
        load_artifact(artifact)
    os.mkfifo(tmp_path / "tripwire")
    (artifact / TENSOR_FILE).unlink()
    os.symlink(tmp_path / "tripwire", artifact / TENSOR_FILE)
    with deadline(), pytest.raises(FileKindError, match="tensors.safetensors is a symbolic link"):
        load_artifact(artifact)


@pytest.mark.parametrize("recipe", ["kvquant-4b-1pct", "kvquant-3b-1pct+smooth+prefix", "fp8-e4m3"])
def test_the_tensor_bound_holds_every_real_artifact_and_refuses_one_byte_past_it(make_artifact, recipe):
    """The bound leaves a real artifact's tensor file well inside (its data, header and the header's copy of the
    bound fields), and refuses by size a file one byte past it: here padded, its sha256 re-made in the manifest and
    the manifest re-signed, so the size is the only check left to refuse it before it is read."""
    path = make_artifact(recipe)
    raw_manifest = (path / MANIFEST_FILE).read_bytes()
    manifest = json.loads(raw_manifest)
    size = (path / TENSOR_FILE).stat().st_size
    bound = tensor_file_bound(manifest, len(raw_manifest))
    assert size < bound < 2 * size + 2 * len(raw_manifest) + (1 << 17)
    load_artifact(path)
    with open(path / TENSOR_FILE, "ab") as f:
        f.write(b"\0" * (bound + 1 - size))
    manifest["tensor_file"]["sha256"] = sha256_of(path / TENSOR_FILE)
    (path / MANIFEST_FILE).write_bytes(serialize_manifest(manifest))
    assert len((path / MANIFEST_FILE).read_bytes()) == len(raw_manifest)  # the same bound
    with pytest.raises(FileSizeError, match=rf"tensors.safetensors is {bound + 1} bytes; allowed at most {bound}"):
        load_artifact(path)


def test_a_manifest_over_its_cap_is_refused_unread(artifact):
    with open(artifact / MANIFEST_FILE, "ab") as f:
        f.write(b" " * MAX_MANIFEST_BYTES)
    with pytest.raises(FileSizeError, match=rf"manifest.json is \d+ bytes; allowed at most {MAX_MANIFEST_BYTES}"):
        load_artifact(artifact)


# ---- a vLLM checkpoint folder: its record's paths stay inside the folder ------------------------------------

@pytest.fixture
def checkpoint(tmp_path, make_artifact, tiny):
    from pipeline.export import write_vllm_checkpoint

    return write_vllm_checkpoint(tmp_path / "ckpt", make_artifact("fp8-e4m3"), tiny)


def record_path(ckpt: Path) -> Path:
    return ckpt / ct.ARTIFACT_DIR / ct.RECORD_FILE


def edit_record(ckpt: Path, edit) -> None:
    record = json.loads(record_path(ckpt).read_text())
    edit(record)
    record_path(ckpt).write_text(json.dumps(record))


def sha256_of(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def test_a_record_naming_a_path_outside_the_folder_is_refused_unlooked(checkpoint, tmp_path):
    """Before: /etc/hostname with its right sha256 was accepted, and with a wrong one the error confirmed the
    file's existence and content; `../x` was hashed too. Now the path is refused on its text alone: the message is
    the same whether the file exists or not, and a FIFO there is never opened."""
    beside = tmp_path / "beside.txt"
    beside.write_text("outside the checkpoint")
    os.mkfifo(tmp_path / "tripwire")
    messages = {}
    for rel, digest in (("/etc/hostname", sha256_of("/etc/hostname")), ("/etc/hostname", "0" * 64),
                        ("/no/such/file", "0" * 64), ("../beside.txt", sha256_of(beside)),
                        ("../tripwire", "0" * 64), (str(tmp_path / "tripwire"), "0" * 64),
                        ("tokenizer.json/../../beside.txt", sha256_of(beside))):
        edit_record(checkpoint, lambda r: r["files"].update({rel: digest}))
        with deadline(), pytest.raises(FileKindError, match="leaves the folder or is ambiguous") as refused:
            ct.verify_checkpoint(checkpoint)
        messages[rel, digest] = str(refused.value).replace(repr(rel), "PATH")
        edit_record(checkpoint, lambda r: r["files"].pop(rel))
        edit_record(checkpoint, lambda r: r["sizes"].pop(rel, None))
    assert len(set(messages.values())) == 1, messages
    ct.verify_checkpoint(checkpoint)  # the record as written still verifies


def test_a_recorded_file_linked_outside_is_refused_unfollowed(checkpoint, tmp_path):
    """Before: a listed file that is a symbolic link was followed and hashed (/etc/hostname, right sha256:
    accepted). A link to a FIFO shows nothing is opened through it."""
    name = "tokenizer_config.json"
    (checkpoint / name).unlink()
    os.symlink("/etc/hostname", checkpoint / name)
    edit_record(checkpoint, lambda r: (r["files"].update({name: sha256_of("/etc/hostname")}),
                                       r["sizes"].update({name: Path("/etc/hostname").stat().st_size})))
    with pytest.raises(FileKindError, match=f"{name} is a symbolic link; allowed a regular file inside the folder"):
        ct.verify_checkpoint(checkpoint)
    os.mkfifo(tmp_path / "tripwire")
    (checkpoint / name).unlink()
    os.symlink(tmp_path / "tripwire", checkpoint / name)
    with deadline(), pytest.raises(FileKindError, match=f"{name} is a symbolic link"):
        ct.verify_checkpoint(checkpoint)


def test_the_artifact_folder_linked_outside_is_refused(checkpoint, tmp_path):
    """Before: kvcalib/ as a link to a folder elsewhere was followed: the artifact came from outside."""
    outside = tmp_path / "elsewhere"
    (checkpoint / ct.ARTIFACT_DIR).rename(outside)
    os.symlink(outside, checkpoint / ct.ARTIFACT_DIR)
    with pytest.raises(ct.CheckpointError, match="kvcalib is a symbolic link; allowed a folder inside the checkpoint"):
        ct.verify_checkpoint(checkpoint)


def test_a_listed_fifo_or_huge_sparse_file_is_refused_at_once(checkpoint):
    """Before: a FIFO listed in the record was called missing, and a huge sparse file was hashed whole (minutes for
    100 GB of holes). Now each is refused by what it is, before a byte is read, with or without recorded sizes."""
    os.mkfifo(checkpoint / "pipe.bin")
    edit_record(checkpoint, lambda r: (r["files"].update({"pipe.bin": "0" * 64}), r["sizes"].update({"pipe.bin": 0})))
    with deadline(), pytest.raises(FileKindError, match=r"pipe.bin is a FIFO \(named pipe\)"):
        ct.verify_checkpoint(checkpoint)
    (checkpoint / "pipe.bin").unlink()
    edit_record(checkpoint, lambda r: (r["files"].pop("pipe.bin"), r["sizes"].pop("pipe.bin")))
    sparse_file(checkpoint / "huge.bin")
    for sizes in (True, False):  # a record with the right size, and one written before sizes were recorded
        edit_record(checkpoint, lambda r: (r["files"].update({"huge.bin": "0" * 64}),
                                           r["sizes"].update({"huge.bin": SPARSE}) if sizes else r.pop("sizes")))
        with deadline(), pytest.raises(FileSizeError, match=rf"huge.bin is {SPARSE} bytes but holds \d+ on disk"):
            ct.verify_checkpoint(checkpoint)


def test_recorded_sizes_are_checked_before_hashing_and_old_records_still_verify(checkpoint):
    """The record carries each file's size: a file of another size is refused without being hashed (a FIFO-free
    way to see it: the message says so). A record without sizes (written before them) still verifies."""
    record = json.loads(record_path(checkpoint).read_text())
    assert record["sizes"]["config.json"] == (checkpoint / "config.json").stat().st_size
    with open(checkpoint / "config.json", "a") as f:
        f.write(" ")
    with pytest.raises(ChecksumError, match=r"config.json: sha256 differs .*found before hashing: \d+ bytes, "
                                            r"recorded \d+"):
        ct.verify_checkpoint(checkpoint)
    edit_record(checkpoint, lambda r: (r.pop("sizes"), r["files"].update({"config.json":
                                                                          sha256_of(checkpoint / "config.json")})))
    ct.verify_checkpoint(checkpoint)


DEEP = "[" * 100_000 + "]" * 100_000


@pytest.mark.parametrize("text,field", [
    ("{not json", "checkpoint.json: not valid UTF-8 JSON"),
    ("[]", "checkpoint.json: allowed a JSON object, got list"),
    ('{"format": "kvcalib-vllm-checkpoint"}', r"checkpoint.json files: allowed a non-empty object"),
    ('{"format": "kvcalib-vllm-checkpoint", "files": 5}', r"checkpoint.json files: allowed a non-empty object"),
    ('{"format": "kvcalib-vllm-checkpoint", "files": {"config.json": 5}}',
     r"checkpoint.json files\['config.json'\]: allowed 64 lowercase hex digits"),
    ('{"format": "kvcalib-vllm-checkpoint", "files": {"config.json": "%s"}, "sizes": {"config.json": "1"}}'
     % ("0" * 64), r"checkpoint.json sizes\['config.json'\]: allowed an integer >= 0"),
    ('{"format": "kvcalib-vllm-checkpoint", "files": ' + DEEP + "}",
     "checkpoint.json: nests objects and arrays deeper"),
    ('{"format": "kvcalib-vllm-checkpoint", "files": {"a": "%s"}, "x": %s}' % ("0" * 64, "[" * 40 + "]" * 40),
     "checkpoint.json: x/0/0/0/.* nests objects and arrays deeper than 32 levels"),
], ids=["not-json", "list", "no-files", "files-int", "digest-int", "size-str", "deep-100000", "deep-40"])
def test_a_malformed_record_is_refused_naming_the_field(checkpoint, text, field):
    """Before: KeyError, TypeError, AttributeError, JSONDecodeError or RecursionError (exit 5)."""
    record_path(checkpoint).write_text(text)
    with pytest.raises(ct.CheckpointError, match=field):
        ct.verify_checkpoint(checkpoint)


@pytest.mark.parametrize("text,field", [
    ("{oops", "config.json: not valid UTF-8 JSON"),
    ("[1, 2]", "config.json: allowed a JSON object, got list"),
    ('{"architectures": ["x"], "x": ' + DEEP + "}", "config.json: nests objects and arrays deeper"),
], ids=["not-json", "list", "deep"])
def test_a_malformed_config_json_is_refused_naming_the_file(checkpoint, text, field):
    """config.json re-recorded (the record stays valid), so its content is what is refused. Before: exit 5."""
    (checkpoint / "config.json").write_text(text)
    record_path(checkpoint).write_text(json.dumps(ct.file_record(checkpoint)))
    with pytest.raises(ManifestError, match=field):
        ct.verify_checkpoint(checkpoint)
