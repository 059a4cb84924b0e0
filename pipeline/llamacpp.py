"""llama.cpp, run for real on the run's own evaluation windows: its KV cache types (`-ctk / -ctv`) computed by
llama.cpp itself (llama-cpp-python, built by scripts/install-llamacpp.sh into .venv-llamacpp) on the model's GGUF
file, so that `pipeline recommend --engine llama.cpp` picks a cache type from measured figures and bench.peers
puts the engine beside our recipes.

The run's side: `llamacpp.types=[q8_0,q4_0,q8_0/q4_0]` (empty: off, the default) runs pipeline/llamacpp_worker.py
in that environment as a subprocess (the two environments never meet: the worker imports numpy and llama_cpp only)
on the evaluation windows' exact ids, and the summary gains `evaluation_llamacpp`: per type, the perplexity ratio
to llama.cpp's own f16 cache on the same windows with its 95% interval (stages.evaluate.ppl_ratio_interval, as for
our recipes), top-1 agreement with f16, and the bits per element of the type's block layout. llama.cpp's f16 is the
reference, not our fp16: llama.cpp multiplies the quantized weights against 8-bit quantized activations, so its
f16 perplexity is close to ours but not the same number; both are recorded.
"""
from __future__ import annotations

import json
import math
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import torch

from pipeline.errors import UserError
from pipeline.llamacpp_config import ROOT, LlamaCppConfig, llamacpp_bits, no_gguf, resolve_python, with_reference

WORKER = Path(__file__).resolve().parent / "llamacpp_worker.py"


def model_gguf(model_cfg, given: str, tmp: Path) -> Path:
    """The GGUF file llama.cpp runs: `given`, else the model's own (embedded SmolLM2's file; Gemma 3's reassembled
    from its chunk packages into tmp; model.source=gguf's model.path/model.gguf_file)."""
    if given:
        path = Path(given).expanduser()
        if not path.is_file():
            raise UserError(f"llamacpp.gguf: no file at {path}")
        return path
    if model_cfg.source == "embedded" and model_cfg.embedded == "smollm2":
        from pipeline.model import EMBEDDED_GGUF, embedded_model_dir
        return embedded_model_dir() / EMBEDDED_GGUF
    if model_cfg.source == "embedded":
        from pipeline.convert import PACKAGES, assemble
        pkg = PACKAGES[model_cfg.embedded]
        path = tmp / pkg.gguf_file
        assemble(pkg, path)
        return path
    if model_cfg.source == "gguf":
        from pipeline.model import EMBEDDED_GGUF
        return Path(model_cfg.path) / (model_cfg.gguf_file or EMBEDDED_GGUF)
    raise no_gguf(model_cfg)


def run_worker(python: str, gguf: Path, windows: torch.Tensor, types: list[str], threads: int, attn_rot: bool,
               tmp: Path) -> dict:
    """pipeline/llamacpp_worker.py in the llama.cpp environment on `windows` [W, T] -> its JSON."""
    rot = "on" if attn_rot else "off"
    tokens, out = tmp / "tokens.npy", tmp / f"llamacpp-rot-{rot}.json"
    np.save(tokens, windows.to(torch.int32).numpy(), allow_pickle=False)
    cmd = [python, str(WORKER), "--gguf", str(gguf), "--tokens", str(tokens), "--types", ",".join(types),
           "--threads", str(threads), "--attn-rot", rot, "--json", str(out)]
    proc = subprocess.run(cmd, cwd=str(ROOT), text=True, capture_output=True)
    if proc.returncode != 0:
        raise RuntimeError(f"llama.cpp worker failed (exit {proc.returncode}): {' '.join(cmd)}\n"
                           f"{proc.stdout[-4000:]}{proc.stderr[-4000:]}")
    return json.loads(out.read_text())


def rows_from(res: dict) -> dict[str, dict]:
    """The worker's per-window NLL sums -> one row per cache type with the ratio to llama.cpp's own f16 cache on
    the same windows (f16's own row: ratio 1)."""
    from stages.evaluate import ppl_ratio_interval

    ref = res["results"]["f16"]
    ref_nll = torch.tensor(ref["sum_nll"], dtype=torch.float64)
    n_tokens = int(ref["n_tokens"][0])
    rows = {}
    for name, r in res["results"].items():
        nll = torch.tensor(r["sum_nll"], dtype=torch.float64)
        ratio, lo, hi = ppl_ratio_interval(nll[None], ref_nll, n_tokens)
        agree = [float(np.mean(np.asarray(a) == np.asarray(b))) for a, b in zip(r["argmax"], ref["argmax"])]
        rows[name] = {"type_k": r["type_k"], "type_v": r["type_v"], "avg_bits": llamacpp_bits(name),
                      "ppl": math.exp(float(nll.sum()) / (n_tokens * len(nll))), "ppl_ratio": ratio,
                      "ppl_ratio_ci95": [lo, hi], "top1": float(np.mean(agree)), "seconds": r.get("seconds")}
    return rows


def evaluate(cfg: LlamaCppConfig, model_cfg, windows: torch.Tensor, log=print) -> dict:
    """llama.cpp's cache types on `windows` -> the summary's `evaluation_llamacpp`."""
    types = with_reference(list(cfg.types))
    python = resolve_python(cfg.python)
    threads = cfg.threads or torch.get_num_threads()
    with tempfile.TemporaryDirectory(prefix="kvcalib-llamacpp-") as tmp:
        gguf = model_gguf(model_cfg, cfg.gguf, Path(tmp))
        log(f"llama.cpp: {len(types)} cache types x {windows.shape[0]} windows x {windows.shape[1]} tokens on "
            f"{gguf.name} ({threads} threads, rotation {'on' if cfg.attn_rot else 'off'})")
        res = run_worker(python, gguf, windows, types, threads, cfg.attn_rot, Path(tmp))
    return {"engine": "llama.cpp", "llama_cpp_version": res.get("llama_cpp_version"), "gguf": gguf.name,
            "gguf_path": None if gguf.parent == Path(tmp) else str(gguf),  # a file reassembled for the run is gone
            "attn_rot": bool(res["attn_rot"]), "threads": threads, "windows": int(windows.shape[0]),
            "seq_len": int(windows.shape[1]), "reference": "llama.cpp f16", "types": rows_from(res)}


def table(ev: dict) -> str:
    """llama.cpp's cache types on the run's windows, each interval as stages.evaluate.interval_text prints it."""
    from stages.evaluate import interval_text

    rows = sorted(ev["types"].items(), key=lambda kv: (-kv[1]["avg_bits"], kv[0]))
    intervals = {name: interval_text(r["ppl_ratio_ci95"], ev.get("windows")) for name, r in rows}
    span = max([18, *(len(i) + 2 for i in intervals.values())])
    head = f"{'cache type':<14}{'bits':>7}{'ppl':>10}{'ppl/f16':>9}  {'95% interval':<{span}}{'top1':>7}"
    lines = [head, "-" * len(head)]
    for name, r in rows:
        lines.append(f"{name:<14}{r['avg_bits']:7.3f}{r['ppl']:10.3f}{r['ppl_ratio']:9.4f}  {intervals[name]:<{span}}"
                     f"{r['top1']:7.4f}")
    return "\n".join(lines)
