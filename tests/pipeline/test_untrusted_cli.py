"""A stranger's artifact through the command line, as a user meets it (`python -m pipeline show|check DIR` in a
subprocess; issue 51, items 3 and 6): what hung, exhausted memory or exited 5 ("a bug") is a refusal with exit 2
naming the file or field, within seconds, writing nothing; a schema-valid manifest with odd values is printed.
Each child runs under a timeout and a 4 GiB address-space limit, so a regression fails instead of taking the
machine's memory."""
import hashlib
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest

from exporters import compressed_tensors as ct
from exporters.artifact import MANIFEST_FILE
from exporters.manifest import TENSOR_FILE
from pipeline.check import result_path
from pipeline.errors import EXIT_OK, EXIT_USER

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 60   # a child's start (torch, the pipeline's imports) is a few seconds; every refusal takes milliseconds


def cli(args: list[str], cwd: Path, env: dict | None = None) -> tuple[subprocess.CompletedProcess, float]:
    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT), **(env or {})}
    start = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "pipeline", *args], cwd=cwd, env=env, capture_output=True, text=True,
                         timeout=TIMEOUT_S, preexec_fn=limit)
    return out, time.monotonic() - start


def assert_refused(out: subprocess.CompletedProcess, *parts: str) -> None:
    assert out.returncode == EXIT_USER, (out.returncode, out.stderr[-3000:])
    assert "internal error" not in out.stderr and "Traceback" not in out.stderr
    for part in parts:
        assert part in out.stderr, (part, out.stderr[-3000:])


@pytest.fixture
def artifact(make_artifact):
    return make_artifact("kvquant-4b-1pct")


def _fifo(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)


def _link_dev_zero(path: Path) -> None:
    path.unlink()
    os.symlink("/dev/zero", path)


def _sparse(path: Path) -> None:
    with open(path, "wb") as f:
        f.truncate(100 << 30)


def _directory(path: Path) -> None:
    path.unlink()
    path.mkdir()


@pytest.mark.parametrize("name,make,says", [
    (MANIFEST_FILE, _fifo, "manifest.json is a FIFO (named pipe)"),
    (TENSOR_FILE, _fifo, "tensors.safetensors is a FIFO (named pipe)"),
    (TENSOR_FILE, _link_dev_zero, "tensors.safetensors is a symbolic link"),
    (TENSOR_FILE, _sparse, f"tensors.safetensors is {100 << 30} bytes; allowed at most"),
    (MANIFEST_FILE, _sparse, f"manifest.json is {100 << 30} bytes; allowed at most"),
    (MANIFEST_FILE, _directory, "manifest.json is a directory; allowed a regular file"),
], ids=["fifo-manifest", "fifo-tensors", "dev-zero-tensors", "sparse-tensors", "sparse-manifest", "manifest-dir"])
def test_show_refuses_what_hung_or_crashed_within_seconds(artifact, tmp_path, name, make, says):
    """Before: the FIFOs and /dev/zero hung (or read until memory ran out), the sparse files and the directory
    exited 5 (MemoryError, IsADirectoryError)."""
    make(artifact / name)
    out, seconds = cli(["show", str(artifact)], tmp_path)
    assert_refused(out, says)
    assert seconds < TIMEOUT_S


def deep_list(levels: int):
    value = 1
    for _ in range(levels):
        value = [value]
    return value


@pytest.mark.parametrize("edit,field", [
    (lambda m: m["model"]["rope"]["scaling"].update(x=deep_list(500)), "manifest field model/rope/scaling/x/0/0"),
    (lambda m: m["model"]["source"]["settings"].update(x=deep_list(900)), "manifest field model/source/settings/x/0"),
], ids=["rope-scaling-500", "source-settings-900"])
def test_show_refuses_deeply_nested_lists_naming_the_field(artifact, tmp_path, forge, edit, field):
    """Re-signed with the tensor file's copy of the bound fields following (forge, rebind): only the nesting is
    left to refuse. Before: RecursionError in the binding's comparison, exit 5."""
    forge(artifact, edit, rebind=True)
    out, _ = cli(["show", str(artifact)], tmp_path)
    assert_refused(out, field, "nesting deeper than 32 levels")


def _failed_without_cases(m):
    m["runtime_check"] = {"status": "failed", "max_abs_err": None, "max_rel_err": None,
                          "tolerance": {"atol": 1e-5, "rtol": 2e-4, "criterion": "max|kernel - oracle|"},
                          "reason": "float32 rounding", "device": "cpu", "triton": "3.4.0", "interpreter": True,
                          "contexts": [64], "batches": [1], "cases": [], "error": "context 64, batch 1: kernel failed"}


def _huge_numbers(m):
    m["model"]["rope"]["theta"] = 10 ** 400
    m["evaluation"] = {m["recipe"]: {"ppl": 10 ** 400, "kl": float("inf"), "top1": 0.5, "avg_bits": float("nan")},
                       "fp16": {"ppl": 1e-300}}


def _odd_text(m):
    m["model"]["name"] = "tiny\x1b[2J\x1b[31m PASSED\r\u2028\ud800 \u00e9"
    m["model"]["architecture"] = "L" * 1_000_000
    m["calibration"] = {"data": {"description": "line\nbreak"}, "stages": {"": {"cache_key": "", "config_sha256": ""}}}


@pytest.mark.parametrize("edit,shown", [
    (_failed_without_cases, ["check      failed (max abs err n/a, tolerance atol 1e-05 rtol 0.0002): context 64, "
                             "batch 1: kernel failed"]),
    (lambda m: m["evaluation"].update({m["recipe"]: {"ppl": 2.0}}),
     ["evaluation ppl 2.000, KL n/a, top-1 n/a, avg bits n/a"]),
    (_huge_numbers, ["RoPE theta 1" + "0" * 39 + "... (401 characters)", "evaluation ppl 1" + "0" * 39 + "... (401 "
                     "characters), KL inf, top-1 0.5000, avg bits nan"]),
    (_odd_text, ["model      tiny\\x1b[2J\\x1b[31m PASSED\\r\\u2028\\ud800 \u00e9 " + "L" * 200
                 + "... (1000000 characters): 2 layers", "data       line\\nbreak: None x None tokens"]),
], ids=["failed-check-without-cases", "evaluation-ppl-only", "huge-numbers", "odd-text"])
def test_show_prints_every_schema_valid_manifest(artifact, tmp_path, forge, edit, shown):
    """Odd but valid values, re-signed (forge, rebind). Before: exit 5 (a null max_abs_err formatted, a missing KL,
    an integer beyond a float, an unpaired surrogate printed) or a terminal escape printed raw."""
    forge(artifact, edit, rebind=True)
    out, _ = cli(["show", str(artifact)], tmp_path)
    assert out.returncode == EXIT_OK, out.stderr[-3000:]
    for line in shown:
        assert line in out.stdout, (line, out.stdout[-3000:])
    assert "\x1b" not in out.stdout and "\r" not in out.stdout


@pytest.fixture
def checkpoint(tmp_path, make_artifact, tiny):
    from pipeline.export import write_vllm_checkpoint

    return write_vllm_checkpoint(tmp_path / "ckpt", make_artifact("fp8-e4m3"), tiny)


def _record(ckpt: Path) -> Path:
    return ckpt / ct.ARTIFACT_DIR / ct.RECORD_FILE


def _hostname_listed(ckpt: Path) -> None:
    record = json.loads(_record(ckpt).read_text())
    record["files"]["/etc/hostname"] = hashlib.sha256(Path("/etc/hostname").read_bytes()).hexdigest()
    record["sizes"]["/etc/hostname"] = Path("/etc/hostname").stat().st_size
    _record(ckpt).write_text(json.dumps(record))


def _config(text: str):
    def write(ckpt: Path) -> None:
        (ckpt / "config.json").write_text(text)
        _record(ckpt).write_text(json.dumps(ct.file_record(ckpt)))  # re-recorded: the content is what is refused
    return write


@pytest.mark.parametrize("command", ["show", "check"])
@pytest.mark.parametrize("make,says", [
    (lambda ckpt: _record(ckpt).write_text("{not json"), "kvcalib/checkpoint.json: not valid UTF-8 JSON"),
    (lambda ckpt: _record(ckpt).write_text('{"format": "kvcalib-vllm-checkpoint", "files": 5}'),
     "kvcalib/checkpoint.json files: allowed a non-empty object"),
    (_hostname_listed, "kvcalib/checkpoint.json files: '/etc/hostname' leaves the folder"),
    (_config("[1, 2]"), "config.json: allowed a JSON object, got list"),
    (_config('{"architectures": ["x"], "x": ' + "[" * 100_000 + "]" * 100_000 + "}"),
     "config.json: nests objects and arrays deeper"),
], ids=["record-not-json", "record-files-int", "record-etc-hostname", "config-list", "config-deep"])
def test_a_malformed_checkpoint_folder_is_refused_writing_nothing(checkpoint, tmp_path, command, make, says):
    """Before: exit 5 (JSONDecodeError, AttributeError, RecursionError), or /etc/hostname accepted with its sha256."""
    make(checkpoint)
    out, _ = cli([command, str(checkpoint)], tmp_path)
    assert_refused(out, says)
    assert not result_path(checkpoint).exists()


def _model_folder(tmp_path: Path, config: str | None) -> Path:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"")  # present, so that the loader reads config.json first
    if config is None:
        os.mkfifo(folder / "config.json")
    else:
        (folder / "config.json").write_text(config)
    return folder


@pytest.mark.parametrize("config,says", [
    ('{"model_type": "llama", "hidden', "config.json: not valid UTF-8 JSON"),
    ('{"model_type": "llama", "x": ' + "[" * 100_000 + "]" * 100_000 + "}", "config.json: nests objects and arrays"),
    ("[1, 2]", "config.json: allowed a JSON object, got list"),
    ('{"hidden_size": 64}', "config.json model_type: allowed one of"),
    (None, "config.json is a FIFO (named pipe); allowed a regular file"),
], ids=["not-json", "deep", "list", "no-model-type", "fifo"])
def test_check_refuses_a_model_folder_with_a_malformed_config_json(artifact, tmp_path, config, says):
    """`check ARTIFACT model.source=local model.path=DIR`: the folder's config.json is refused naming model.path and
    the field before transformers reads it. Before: exit 5 (OSError, RecursionError, ValueError) or, for a FIFO, a
    refusal calling config.json missing."""
    folder = _model_folder(tmp_path, config)
    out, _ = cli(["check", str(artifact), "model.source=local", f"model.path={folder}", "contexts=[8]", "batches=[1]"],
                 tmp_path)
    assert_refused(out, f"model.path={str(folder)!r}", says)
    assert not result_path(artifact).exists()
