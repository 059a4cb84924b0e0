"""The one command to run on a GPU machine: every device path of kvcalib in one go, within 8 minutes on one GPU.

    python -m bench.gpu_smoke --out DIR                  # on a machine with a CUDA GPU (scripts/gpu-run.sh there)
    python -m bench.gpu_smoke --out DIR --cpu            # dry run (CI): the same parts on the CPU, tiny sizes,
                                                         # Triton interpreted
    python -m bench.gpu_smoke --save-tokenizer DIR       # the embedded tokenizer as a folder (scripts/gpu-wheels.sh)

Parts, in this order, each in its own try (a failure is recorded and the next part runs):
  env                    device, library versions, the tokenizer used
  imports                every module the parts need imports (hydra / omegaconf / jsonschema come as carried wheels)
  pipeline:tiny          the pipeline on model=tiny in bfloat16 with model.device=cuda: traces, Fisher, key scales,
                         outliers, codebooks, evaluation of fp16 / fp8-e4m3 / kivi-4 / kvquant-4b-1pct, sensitivity,
                         probes, export (tracking, gate and the vLLM folder off)
  check:tiny             the runtime check on that artifact: the compiled Triton kernel against the oracle
  pipeline:tiny-rotclipv the same on model=tiny with kvquant-2b+sink16+recent32+rotclipv: rotated, clipped 2-bit values
  check:tiny-rotclipv    its runtime check: the Triton kernel's rotated value sum, un-rotated once per query head
  kernel                 decode attention from the stored form vs torch SDPA on fp16 K/V at 4k-128k tokens, batch 1
                         and 8: time per step, ratio, bytes read (bench/kernel.py)
  pipeline:llama3-shape  the same pipeline on model=llama3-shape (Llama-3-8B's shapes, 4 layers, random weights)
  check:llama3-shape     the runtime check on its artifact
  generate               generate() of 8k-token prompts through the serving cache (serving/cache.py with the
                         block-wise attention) beside transformers' DynamicCache: torch.cuda.max_memory_allocated
                         above the weights, cache bytes, prefill and decode time

Each part prints its status and elapsed time as it ends (flushed), and DIR/gpu_smoke.json is rewritten after every
part: a run cut at its limit still says what passed. A part still running at its own cap or at the end of the
global budget (--budget-s) is cut there (SIGALRM), and the parts left are skipped with the reason. Exit status 0
only when every part passed; 1 otherwise. DIR/gpu_smoke.log holds the same lines plus the pipeline's and the
check's own output. docs/gpu.md says how to read the JSON.

This module imports only the standard library at its top: a missing package fails the part that needs it, never
the script. The dry run (--cpu) checks the wiring of every part; it proves nothing about CUDA.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import json
import math
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
CARRIED_TOKENIZER = ROOT / ".gpu-wheels" / "tokenizer"   # scripts/gpu-wheels.sh saves it there
RECIPE = "kvquant-4b-1pct"
# the second tiny run (its parts' label): rotated, clipped 2-bit values (the Triton kernel's second value sum,
# un-rotated once)
ROTATED_LABEL, ROTATED_RECIPE = "tiny-rotclipv", "kvquant-2b+sink16+recent32+rotclipv"
EVAL_RECIPES = ["fp16", "fp8-e4m3", "kivi-4"]
JSON_NAME, LOG_NAME = "gpu_smoke.json", "gpu_smoke.log"
VERSIONED = ("torch", "triton", "transformers", "accelerate", "tokenizers", "safetensors", "numpy", "scikit-learn",
             "hydra-core", "omegaconf", "antlr4-python3-runtime", "jsonschema", "referencing", "rpds-py")


@dataclass(frozen=True)
class Sizes:
    """Everything the GPU run and the dry run do differently: sizes, not steps."""
    calib: tuple[int, int]                   # windows, tokens
    evaluate: tuple[int, int]
    reservoir: int
    probe_lengths: list[int]
    buckets: list[int]
    check_contexts: dict[str, list[int]]     # per model
    check_batches: list[int]
    shape_layers: int
    kernel_contexts: list[int]
    kernel_batches: list[int]
    kernel_formats: list[str]
    generate_prompt: int
    generate_new: int
    caps_s: dict[str, float] = field(default_factory=dict)  # per part: cut after this many seconds


GPU = Sizes(calib=(4, 1024), evaluate=(2, 1024), reservoir=4096, probe_lengths=[2048], buckets=[0, 128, 512],
            check_contexts={"tiny": [64, 1024, 4000], "tiny-rotclipv": [64, 1024, 4000],
                            "llama3-shape": [64, 1024, 8192]}, check_batches=[1, 2],
            shape_layers=4, kernel_contexts=[4096, 16384, 65536, 131072], kernel_batches=[1, 8],
            kernel_formats=["nuq-4", "nuq-2", "nuq-4-1pct", "fp8"], generate_prompt=8192, generate_new=32,
            caps_s={"env": 60, "imports": 90, "pipeline:tiny": 90, "check:tiny": 60, "pipeline:tiny-rotclipv": 90,
                    "check:tiny-rotclipv": 60, "kernel": 120,
                    "pipeline:llama3-shape": 150, "check:llama3-shape": 90, "generate": 90})
DRY = Sizes(calib=(2, 64), evaluate=(1, 64), reservoir=128, probe_lengths=[128], buckets=[0, 32],
            check_contexts={"tiny": [48], "tiny-rotclipv": [112], "llama3-shape": [48]}, check_batches=[1],
            shape_layers=2, kernel_contexts=[64], kernel_batches=[2], kernel_formats=["nuq-4-1pct", "fp8"],
            generate_prompt=128, generate_new=3)
# the dry run cannot build Llama-3-8B's embeddings (2 x 128256 x 4096) in CI: its llama3-shape parts run a tiny
# model with Llama-3's head grouping (4 query heads per KV head) and RoPE base instead
DRY_SHAPE_STAND_IN = dict(n_layers=2, hidden_size=128, n_q_heads=4, n_kv_heads=1, intermediate_size=256,
                          rope_theta=500000.0)


class Skipped(Exception):
    """A part's inputs are missing (an earlier part failed, no GPU): it is skipped with this reason."""


class PartTimeout(BaseException):
    """Raised by SIGALRM when a part runs past its limit; a BaseException so that no `except Exception` in the code
    under test swallows it."""


@dataclass
class Smoke:
    """The run's state: what parts hand to later ones, the report, and where it is written."""
    gpu: bool
    sizes: Sizes
    out: Path
    work: Path
    tokenizer: str
    budget_s: float
    started: float = field(default_factory=time.monotonic)
    models: dict = field(default_factory=dict)     # "tiny" | "llama3-shape" -> {"lm", "artifact_dir"}
    report: dict = field(default_factory=dict)
    _log: object = None

    @property
    def device(self) -> str:
        return "cuda" if self.gpu else "cpu"

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def say(self, line: str) -> None:
        """A line for stdout and the log."""
        print(line, flush=True)
        self.note(line)

    def note(self, line: str) -> None:
        """A line for the log only (the pipeline's and the check's own output)."""
        if self._log is None:
            self._log = open(self.out / LOG_NAME, "a", buffering=1)
        self._log.write(line.rstrip("\n") + "\n")

    def close(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None

    def write(self) -> None:
        self.report["wall_s"] = self.elapsed()
        tmp = self.out / (JSON_NAME + ".tmp")
        tmp.write_text(json.dumps(jsonable(self.report), indent=1, allow_nan=False) + "\n")
        tmp.replace(self.out / JSON_NAME)


def jsonable(x):
    """Plain JSON: non-finite floats -> None (a failed figure is never written as a bare NaN / Infinity), tensors and
    numpy scalars -> numbers, paths -> strings."""
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple, set)):
        return [jsonable(v) for v in x]
    if isinstance(x, bool) or x is None or isinstance(x, (int, str)):
        return x
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, Path):
        return str(x)
    if hasattr(x, "tolist"):  # tensors, numpy arrays and scalars
        return jsonable(x.tolist())
    return str(x)


# ---- running the parts ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Part:
    name: str
    run: Callable[[Smoke], tuple[dict, list[str]]]   # -> (figures, problems); raises Skipped when it cannot run


@contextlib.contextmanager
def time_limit(seconds: float):
    """Raise PartTimeout in the main thread after `seconds` (no limit where SIGALRM is unavailable)."""
    if seconds <= 0 or not hasattr(signal, "setitimer") or not _main_thread():
        yield
        return

    def expire(_sig, _frame):
        raise PartTimeout()

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


MIN_PART_S = 5.0  # a part is not started with less of the budget left


def run_parts(smoke: Smoke, parts: list[Part]) -> bool:
    """Every part in order, each in its own try and time limit; the report is rewritten after each. -> all passed."""
    parts_report = smoke.report.setdefault("parts", {})
    problems = smoke.report.setdefault("problems", [])
    for part in parts:
        rec = parts_report[part.name] = {"status": "running", "started_s": round(smoke.elapsed(), 1)}
        smoke.write()
        left = smoke.budget_s - smoke.elapsed()
        limit = min(smoke.sizes.caps_s.get(part.name, math.inf), left)
        t0 = time.monotonic()
        if left < MIN_PART_S:
            rec.update(status="skipped", reason=f"time budget spent: {smoke.elapsed():.0f} s of --budget-s "
                                                f"{smoke.budget_s:.0f}")
        else:
            rec["limit_s"] = None if math.isinf(limit) else round(limit, 1)
            try:
                with time_limit(limit if math.isfinite(limit) else 0):
                    figures, found = part.run(smoke)
                rec.update(status="failed" if found else "passed", figures=figures, problems=found)
                problems.extend(f"{part.name}: {p}" for p in found)
            except Skipped as exc:
                rec.update(status="skipped", reason=str(exc))
            except PartTimeout:
                why = "the global --budget-s" if limit < smoke.sizes.caps_s.get(part.name, math.inf) else "its cap"
                rec.update(status="failed", error=f"cut after {limit:.0f} s ({why})")
                problems.append(f"{part.name}: cut after {limit:.0f} s ({why})")
            except (Exception, SystemExit) as exc:  # recorded; the next part still runs
                rec.update(status="failed", error=f"{type(exc).__name__}: {exc}",
                           traceback=traceback.format_exc()[-4000:])
                problems.append(f"{part.name}: {type(exc).__name__}: {exc}")
                smoke.note(traceback.format_exc())
            finally:
                _release(smoke)
        rec["wall_s"] = round(time.monotonic() - t0, 2)
        reason = rec.get("reason") or rec.get("error") or "; ".join(rec.get("problems", []))
        smoke.say(f"[{smoke.elapsed():6.1f} s] {part.name:<22} {rec['status']:<7} in {rec['wall_s']:6.1f} s"
                  + (f"  ({reason[:300]})" if reason else ""))
        smoke.write()
    statuses = [r["status"] for r in parts_report.values()]
    return bool(statuses) and all(s == "passed" for s in statuses)


def _release(smoke: Smoke) -> None:
    gc.collect()
    if smoke.gpu and "torch" in sys.modules:
        import torch

        torch.cuda.empty_cache()


# ---- the parts ----------------------------------------------------------------------------------------------

def part_env(smoke: Smoke) -> tuple[dict, list[str]]:
    from importlib.metadata import PackageNotFoundError, version

    versions = {"python": platform.python_version()}
    for dist in VERSIONED:
        try:
            versions[dist] = version(dist)
        except PackageNotFoundError:
            versions[dist] = None
    device = {"host": platform.node(), "cpus": os.cpu_count(), "mode": "gpu" if smoke.gpu else "cpu dry run",
              "triton_interpret": os.environ.get("TRITON_INTERPRET")}
    problems = []
    import torch

    versions["torch_cuda"] = torch.version.cuda
    device["cuda_available"] = torch.cuda.is_available()
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        device.update(name=props.name, capability=list(torch.cuda.get_device_capability(0)),
                      memory_gib=props.total_memory / 2 ** 30, multiprocessors=props.multi_processor_count,
                      count=torch.cuda.device_count())
    if smoke.gpu and not torch.cuda.is_available():
        problems.append("no CUDA GPU visible (torch.cuda.is_available() is False); use --cpu for the dry run")
    if smoke.gpu and os.environ.get("TRITON_INTERPRET") == "1":
        problems.append("TRITON_INTERPRET=1 is set: the kernels would run interpreted, not compiled")
    smoke.report["device"], smoke.report["versions"] = device, versions
    smoke.report["tokenizer"] = smoke.tokenizer
    smoke.report["code"] = _code_identity()
    return {"device": device, "versions": versions}, problems


def _code_identity() -> dict:
    """The commit and how many files differ from it, when the tree is a git checkout (the GPU copy may not be)."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return {"commit": None}
    if head.returncode:
        return {"commit": None}
    return {"commit": head.stdout.strip(), "changed_files": len(dirty.stdout.splitlines())}


IMPORTS = ("torch", "triton", "transformers", "accelerate", "safetensors", "sklearn", "omegaconf", "hydra",
           "jsonschema", "pipeline.config", "pipeline.app", "pipeline.check", "exporters.native",
           "serving.cache", "serving.blockwise", "serving.triton_attention", "bench.kernel")


def part_imports(smoke: Smoke) -> tuple[dict, list[str]]:
    """Each module the parts need, imported on its own: the first missing package is named here, not mid-part."""
    figures, problems = {}, []
    for name in IMPORTS:
        try:
            module = importlib.import_module(name)
            figures[name] = str(Path(getattr(module, "__file__", "") or "").parent)
        except Exception as exc:
            figures[name] = f"{type(exc).__name__}: {exc}"
            problems.append(f"import {name}: {type(exc).__name__}: {exc}")
    return figures, problems


def _require_gpu(smoke: Smoke) -> None:
    import torch

    if smoke.gpu and not torch.cuda.is_available():
        raise Skipped("no CUDA GPU visible")


def model_config(smoke: Smoke, name: str):
    """conf/model/<name>.yaml in bfloat16 on the run's device, the tokenizer the run carries; the dry run's llama3-shape
    is the tiny stand-in (DRY_SHAPE_STAND_IN)."""
    from pipeline.config import load_model_config

    if name == "llama3-shape" and not smoke.gpu:
        cfg = load_model_config("tiny")
        for k, v in DRY_SHAPE_STAND_IN.items():
            setattr(cfg.tiny, k, v)
    else:
        cfg = load_model_config(name)
    cfg.dtype, cfg.device = "bfloat16", smoke.device
    cfg.tiny.tokenizer = cfg.shape.tokenizer = smoke.tokenizer
    cfg.shape.n_layers = smoke.sizes.shape_layers
    return cfg


def run_config(smoke: Smoke, name: str, recipe: str = RECIPE, label: str | None = None):
    """The calibrated recipe beside fp16, FP8 and KIVI-4 on `name`; export on, its runtime check a part of its own.
    label: the run's folder (default: name)."""
    from pipeline.config import DataConfig, EvalConfig, RunConfig, load_recipe

    s = smoke.sizes
    cfg = RunConfig(model=model_config(smoke, name),
                    data=DataConfig(n_samples=s.calib[0], seq_len=s.calib[1], eval_n_samples=s.evaluate[0],
                                    eval_seq_len=s.evaluate[1]),
                    quant=load_recipe(recipe), eval=EvalConfig(recipes=list(EVAL_RECIPES)),
                    cache_dir=str(smoke.work / (label or name) / "cache"))
    cfg.traces.reservoir_size = s.reservoir
    cfg.probes.lengths, cfg.probes.depths = list(s.probe_lengths), [0.5]
    cfg.sensitivity.buckets, cfg.sensitivity.seq_len = list(s.buckets), 0  # the map on the whole window
    cfg.gate.enabled = False      # its thresholds judge the full protocol, not a smoke test's few short windows
    cfg.check.enabled = False     # the check:<model> part runs it on the artifact
    cfg.tracking.enabled = False  # no MLflow on the GPU machine
    cfg.export.vllm = False
    return cfg


def _result_devices(results: dict) -> list[str]:
    return sorted({t.device.type for r in results.values() for t in r.tensors.values()})


def pipeline_part(name: str, recipe: str = RECIPE, label: str | None = None) -> Part:
    """`run_pipeline` of `recipe` on model `name`; the part and its artifact are known as `label` (default: name)."""
    label = label or name

    def run(smoke: Smoke) -> tuple[dict, list[str]]:
        _require_gpu(smoke)
        import torch

        from pipeline.app import run_pipeline

        cfg = run_config(smoke, name, recipe, label)
        if smoke.gpu:
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        out = run_pipeline(cfg, smoke.work / label / "run", log=lambda m: smoke.note(f"    {m}"), show_progress=False)
        wall = time.perf_counter() - t0
        lm, summary = out["model"], out["summary"]
        params = list(lm.model.parameters())
        smoke.models[label] = {"lm": lm, "artifact_dir": summary.get("artifact_dir")}
        recipes = summary.get("evaluation", {}).get("recipes", {})
        figures = {
            "recipe": recipe,
            "model": {"name": cfg.model.name, "source": cfg.model.source, "n_layers": lm.spec.n_layers,
                      "n_q_heads": lm.spec.n_q_heads, "n_kv_heads": lm.spec.n_kv_heads, "head_dim": lm.spec.head_dim,
                      "dtype": str(params[0].dtype), "parameters": sum(p.numel() for p in params),
                      "stand_in": None if smoke.gpu or name == "tiny" else "tiny model with Llama-3's GQA 4:1 "
                                                                          "(the dry run builds no 128k vocabulary)"},
            "model_devices": sorted({p.device.type for p in params}),
            "stage_result_devices": _result_devices(out["results"]),
            "pipeline_s": wall,
            "stages_s": {r["name"]: r["wall_s"] for r in summary["stages"] if r.get("status") == "computed"},
            "ppl_ratio": {n: r.get("ppl_ratio") for n, r in recipes.items()},
            "kl": {n: r.get("kl") for n, r in recipes.items()},
            "artifact_bytes": _folder_bytes(summary.get("artifact_dir")),
            "peak_gpu_mib": torch.cuda.max_memory_allocated() / 2 ** 20 if smoke.gpu else None,
        }
        problems = []
        if figures["model_devices"] != [smoke.device]:
            problems.append(f"model parameters on {figures['model_devices']}, asked for {smoke.device}")
        if figures["stage_result_devices"] not in ([], ["cpu"]):
            problems.append(f"stage results on {figures['stage_result_devices']}: stages must store results on CPU")
        missing = {recipe, *EVAL_RECIPES} - set(recipes)
        if missing:
            problems.append(f"evaluation lacks {sorted(missing)}")
        bad = sorted(n for n, r in figures["ppl_ratio"].items() if r is None or not math.isfinite(r))
        if bad:
            problems.append(f"non-finite ppl_ratio for {bad}")
        if not summary.get("artifact_dir"):
            problems.append("no artifact exported")
        return figures, problems

    return Part(f"pipeline:{label}", run)


def _folder_bytes(directory: str | None) -> int | None:
    if not directory:
        return None
    return sum(p.stat().st_size for p in Path(directory).rglob("*") if p.is_file())


def check_part(name: str) -> Part:
    def run(smoke: Smoke) -> tuple[dict, list[str]]:
        _require_gpu(smoke)
        got = smoke.models.get(name, {})
        if not got.get("artifact_dir"):
            raise Skipped(f"no artifact: pipeline:{name} did not export one")  # name: a pipeline part's label
        from pipeline.check import run_check
        from pipeline.check_config import CheckConfig

        contexts = list(smoke.sizes.check_contexts[name])
        cfg = CheckConfig(contexts=contexts, gpu_contexts=contexts, batches=list(smoke.sizes.check_batches))
        result = run_check(got["artifact_dir"], got["lm"], cfg, log=lambda m: smoke.note(f"    {m}"))
        problems = []
        if result.get("status") != "passed":
            why = result.get("error", "kernel and oracle disagree")
            problems.append(f"runtime check {result.get('status')}: {why}")
        if result.get("interpreter") is not (not smoke.gpu):
            problems.append(f"runtime check interpreter={result.get('interpreter')} on {smoke.device}")
        return result, problems

    return Part(f"check:{name}", run)


def part_kernel(smoke: Smoke) -> tuple[dict, list[str]]:
    _require_gpu(smoke)
    from bench import kernel
    from runtime_check.check import RTOL

    s = smoke.sizes
    cap = min(s.caps_s.get("kernel", math.inf), smoke.budget_s - smoke.elapsed())
    deadline = time.monotonic() + 0.6 * cap if math.isfinite(cap) else None  # room for the last pair started
    smoke.note(kernel.HEADER)
    res = kernel.measure(s.kernel_contexts, s.kernel_batches, s.kernel_formats, smoke.device, deadline=deadline,
                         on_row=lambda r: smoke.note(kernel.format_row(r)))
    problems = [f"{r['format']} at {r['context']} x {r['batch']}: max_rel_err {r['max_rel_err']:.3g} > rtol {RTOL:g}"
                for r in res["rows"] if r["max_rel_err"] is not None and not r["max_rel_err"] <= RTOL]
    problems += [f"{r['format']} at {r['context']} x {r['batch']}: non-finite time" for r in res["rows"]
                 if not all(math.isfinite(r[k]) for k in ("step_ms", "prepare_step_ms", "sdpa_ms"))]
    problems += [f"not measured: {x['context']} x {x['batch']} ({x['reason']})" for x in res["skipped"]]
    return res, problems


def part_generate(smoke: Smoke) -> tuple[dict, list[str]]:
    """generate() of one prompt through the artifact's serving cache (block-wise attention) and through
    transformers' DynamicCache: peak device memory above the weights, cache bytes, prefill and decode time."""
    _require_gpu(smoke)
    got = smoke.models.get("llama3-shape", {})
    if not got.get("artifact_dir"):
        raise Skipped("no artifact: pipeline:llama3-shape did not export one")
    import torch
    from transformers import DynamicCache

    from exporters.native import load_artifact
    from pipeline.check import eval_ids
    from serving.blockwise import generate
    from serving.cache import cache_kwargs

    lm, s = got["lm"], smoke.sizes
    policy = load_artifact(got["artifact_dir"], lm.spec).policy
    prompt = eval_ids(lm.tokenizer, 1, s.generate_prompt).to(next(lm.model.parameters()).device)
    mask = torch.ones_like(prompt)
    kw = {"do_sample": False, "pad_token_id": lm.tokenizer.eos_token_id}

    def served(new: int, kind: str):
        if kind == "fp16":
            cache = DynamicCache(config=lm.model.config)
            out = lm.model.generate(prompt, attention_mask=mask, **cache_kwargs(lm.model, cache), max_new_tokens=new,
                                    min_new_tokens=new, **kw)
        else:
            out, cache = generate(lm.model, policy, prompt, attention_mask=mask, max_new_tokens=new,
                                  min_new_tokens=new, **kw)
        return out, cache

    rows, outputs = {}, {}
    for kind in ("fp16", "artifact"):
        with torch.no_grad():
            _sync(smoke)
            base = _allocated(smoke)
            t0 = time.perf_counter()
            served(1, kind)                      # the prompt's prefill and the first token
            _sync(smoke)
            prefill_s = time.perf_counter() - t0
            _reset_peak(smoke)
            t0 = time.perf_counter()
            out, cache = served(s.generate_new, kind)
            _sync(smoke)
            total_s = time.perf_counter() - t0
        peak = _peak(smoke)
        outputs[kind] = out[0, prompt.shape[1]:].tolist()
        rows[kind] = {"prefill_s": prefill_s, "total_s": total_s,
                      "decode_ms_per_token": 1000 * max(total_s - prefill_s, 0.0) / max(s.generate_new - 1, 1),
                      "peak_mib_above_weights": None if peak is None else (peak - base) / 2 ** 20,
                      "cache_mib": _cache_bytes(cache) / 2 ** 20, "new_tokens": len(outputs[kind])}
        if kind == "artifact":
            rows[kind]["accounting_bytes"] = cache.accounting()
        del out, cache
        _release(smoke)
    same = sum(a == b for a, b in zip(outputs["fp16"], outputs["artifact"]))
    figures = {"prompt_tokens": int(prompt.shape[1]), "new_tokens": s.generate_new, "policy": policy.name,
               "rows": rows, "greedy_agreement": same / max(len(outputs["fp16"]), 1),
               "weights_mib": sum(p.numel() * p.element_size() for p in lm.model.parameters()) / 2 ** 20,
               "memory": "torch.cuda.max_memory_allocated during generate - memory_allocated before it"
               if smoke.gpu else None}
    problems = [f"{kind}: {r['new_tokens']} new tokens, asked for {s.generate_new}" for kind, r in rows.items()
                if r["new_tokens"] != s.generate_new]
    return figures, problems


def _cache_bytes(cache) -> int:
    if hasattr(cache, "nbytes"):
        return int(cache.nbytes())
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values)
               if t is not None)


def _sync(smoke: Smoke) -> None:
    if smoke.gpu:
        import torch
        torch.cuda.synchronize()


def _allocated(smoke: Smoke) -> int | None:
    if not smoke.gpu:
        return None
    import torch
    return torch.cuda.memory_allocated()


def _reset_peak(smoke: Smoke) -> None:
    if smoke.gpu:
        import torch
        torch.cuda.reset_peak_memory_stats()


def _peak(smoke: Smoke) -> int | None:
    if not smoke.gpu:
        return None
    import torch
    return torch.cuda.max_memory_allocated()


PARTS = [Part("env", part_env), Part("imports", part_imports), pipeline_part("tiny"), check_part("tiny"),
         pipeline_part("tiny", ROTATED_RECIPE, ROTATED_LABEL), check_part(ROTATED_LABEL), Part("kernel", part_kernel),
         pipeline_part("llama3-shape"), check_part("llama3-shape"), Part("generate", part_generate)]


# ---- the command ----------------------------------------------------------------------------------------------

def resolve_tokenizer(arg: str) -> str:
    """auto: the folder scripts/gpu-wheels.sh saved the embedded tokenizer to (.gpu-wheels/tokenizer) when it is
    there -- the GPU machine has neither the GGUF nor the gguf package, and the folder loads in a second where the
    GGUF takes ten -- else the embedded GGUF's tokenizer."""
    if arg != "auto":
        return arg
    if (CARRIED_TOKENIZER / "tokenizer.json").is_file():
        return str(CARRIED_TOKENIZER)
    return "embedded"  # without the GGUF the pipeline parts say why they cannot load it


def save_tokenizer(directory: str) -> int:
    """The embedded tokenizer (model.tiny / model.shape tokenizer=embedded) saved to a folder another machine loads
    without the GGUF or the gguf package."""
    from transformers import AutoTokenizer

    from pipeline.model import EMBEDDED_GGUF, embedded_model_dir

    tok = AutoTokenizer.from_pretrained(str(embedded_model_dir()), gguf_file=EMBEDDED_GGUF)
    tok.save_pretrained(directory)
    print(f"saved the embedded tokenizer to {directory}")
    return 0


def main(argv: list[str] | None = None, parts: list[Part] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="folder for gpu_smoke.json and gpu_smoke.log (created)")
    ap.add_argument("--cpu", action="store_true", help="dry run on the CPU: tiny sizes, Triton interpreted")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="the whole run's seconds: the part running then is cut, the rest skipped (default 420 on "
                         "a GPU, 900 for --cpu)")
    ap.add_argument("--tokenizer", default="auto",
                    help="'embedded', a folder with a saved tokenizer, or auto (the folder "
                         f"{CARRIED_TOKENIZER.relative_to(ROOT)} when it is there, else embedded)")
    ap.add_argument("--work", default=None, help="folder for the runs' caches and artifacts (default: a temporary one)")
    ap.add_argument("--parts", default=None,
                    help=f"comma-separated subset to run (a rerun of what failed; a check or generate needs its "
                         f"pipeline part too), of: {','.join(p.name for p in PARTS)}")
    ap.add_argument("--save-tokenizer", metavar="DIR", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.save_tokenizer:
        return save_tokenizer(args.save_tokenizer)
    if not args.out:
        ap.error("--out DIR is required")
    chosen = PARTS if parts is None else parts
    if args.parts:
        wanted = args.parts.split(",")
        unknown = sorted(set(wanted) - {p.name for p in chosen})
        if unknown:
            ap.error(f"--parts: unknown {unknown}; choose from {[p.name for p in chosen]}")
        chosen = [p for p in chosen if p.name in wanted]
    if args.cpu:
        os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / LOG_NAME).unlink(missing_ok=True)
    budget = args.budget_s if args.budget_s is not None else (900.0 if args.cpu else 420.0)
    with contextlib.ExitStack() as stack:
        work = Path(args.work) if args.work else Path(stack.enter_context(tempfile.TemporaryDirectory()))
        smoke = Smoke(gpu=not args.cpu, sizes=DRY if args.cpu else GPU, out=out, work=work,
                      tokenizer=resolve_tokenizer(args.tokenizer), budget_s=budget)
        smoke.report.update(script="bench.gpu_smoke", mode="cpu dry run" if args.cpu else "gpu", ok=False,
                            budget_s=budget, started_utc=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                            argv=list(sys.argv[1:] if argv is None else argv))
        smoke.say(f"bench.gpu_smoke ({smoke.report['mode']}): budget {budget:.0f} s, out {out}")
        ok = run_parts(smoke, chosen)
        smoke.report["ok"], smoke.report["exit_status"] = ok, 0 if ok else 1
        smoke.write()
        failed = [n for n, r in smoke.report["parts"].items() if r["status"] != "passed"]
        smoke.say(f"bench.gpu_smoke: {'ok' if ok else 'NOT ok: ' + ', '.join(failed)} in {smoke.elapsed():.1f} s; "
                  f"wrote {out / JSON_NAME} and {out / LOG_NAME}")
        smoke.models.clear()
        smoke.close()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
