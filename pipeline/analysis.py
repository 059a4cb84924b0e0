"""After the stage graph: where the error lands -- the layer x position map and passkey probes (the graph's
sensitivity and probes stages), the drift gate -- and report.md."""
from __future__ import annotations

import csv
import io
from pathlib import Path

import torch

from exporters.codec import CachePolicy
from exporters.ledger import predict_bytes
from pipeline import faults
from exporters.files import atomic_write_text
from stages import evaluate, gate, sensitivity
from stages.hooks import model_device


def drift(cfg, results: dict, target: CachePolicy) -> dict:
    """Layer x position map on evaluation windows, passkey probes (the graph's sensitivity and probes stages),
    gate. -> JSON-able dict."""
    out: dict = {}
    sens = None
    if "sensitivity" in results:
        res = results["sensitivity"]
        t = res.tensors
        sens = {"bucket_edges": res.meta["bucket_edges"], "map_kl": t["map_kl"].tolist(),
                "variants": list(cfg.sensitivity.variants),
                "map_cos": t["map_cos"].tolist(), "layer_kl": {v: t["kl"][i].tolist() for i, v in enumerate(sensitivity.VARIANTS)},
                "layer_top1": {v: t["top1"][i].tolist() for i, v in enumerate(sensitivity.VARIANTS)}}
        out["sensitivity"] = sens
    passkey = None
    if "probes" in results:
        meta = results["probes"].meta
        passkey = {"fp16": meta["accuracy"]["fp16"], target.name: meta["accuracy"][target.name]}
        out["probes"] = meta
    if cfg.gate.enabled:
        long = results["evaluate-long"].meta if "evaluate-long" in results else None
        out["gate"] = gate.fit(gate.Inputs(target.name, results["evaluate"].meta["recipes"], sens, passkey, long),
                               cfg.gate).meta
    return out


EXAMPLES_WITHIN = 4096  # changed_examples reads a window's first this many positions (a 32k window: an eighth)


def changed_examples(lm, window: torch.Tensor, target: CachePolicy, n: int = 5, context: int = 12) -> list[dict]:
    """The first n positions among the window's first EXAMPLES_WITHIN where the quantized cache changes the greedy
    next token. A position's tokens depend on the positions before it only (causal attention, and the cache serves
    a row the same way whatever follows), so a prefix gives the whole window's first changes -- up to float
    rounding, which differs with a forward's length (SDPA's blocking) and which a coarse cache can amplify at a
    code's rounding boundary into another token (as on another machine: evaluate.Perturbation) -- without the
    window's forwards at 32k (330 s here for Gemma 3's, docs/long-context.md)."""
    length = min(window.numel(), EXAMPLES_WITHIN)
    ids = window[None, :length].to(model_device(lm.model))  # the window is on the CPU; the model may be on a GPU
    with torch.no_grad():  # hidden states, then the head chunk by chunk: a long window's [T, V] logits do not fit
        ref = evaluate.greedy_tokens(lm.model, evaluate.full_precision_hidden(lm.model, ids)).tolist()
        got = evaluate.greedy_tokens(lm.model, evaluate.policy_hidden(lm.model, ids, target)).tolist()
    changed = [i for i, (a, b) in enumerate(zip(ref, got)) if a != b]
    tok = lm.tokenizer
    rows = []
    for pos in changed[:n]:
        rows.append({"position": pos, "context": tok.decode(window[max(0, pos - context + 1): pos + 1]),
                     "fp16": tok.decode(ref[pos : pos + 1]), "quantized": tok.decode(got[pos : pos + 1])})
    return rows


def write_report(run_dir: Path, summary: dict, target: CachePolicy, spec, examples: list[dict]) -> Path:
    """report.md + frontier.png + heatmaps (PNG and CSV) in run_dir."""
    from pipeline.plots import heatmap, ppl_vs_bits

    recipes = dict(summary.get("evaluation", {}).get("recipes", {}))
    if "mixed" in summary:
        recipes[target.name] = summary["mixed"]["recipe"]
    lines = [f"# kvcalib report: {target.name} on {spec.name}", "",
             f"Data: {summary['data']['description']}; calibration {summary['data']['n_samples']} x "
             f"{summary['data']['seq_len']} tokens, evaluation {summary['data']['eval_n_samples']} x "
             f"{summary['data']['eval_seq_len']} tokens.", ""]
    for warning in summary.get("sanity", {}).get("warnings", []):  # the model's own (pipeline.sanity), above the figures
        lines += [f"**Warning:** {warning}", ""]
    if recipes:
        ppl_vs_bits(recipes, run_dir / "frontier.png")
        lines += ["## Quality per bit (same windows, one run)", "", "![frontier](frontier.png)", "", "```",
                  evaluate.table(recipes, n_windows=summary.get("evaluation", {}).get("windows")), "```", ""]
        long = summary.get("evaluation_long")
        if long:
            lines += [f"## At long context ({long['windows']} windows x {long['seq_len']} tokens, evaluate-long)", "",
                      "```", evaluate.table(long["recipes"], n_windows=long["windows"]), "```", ""]
        from pipeline.recommend import VLLM_FORMATS, format_recommendation, recommend
        if any(name in recipes and name != "fp16" for name in VLLM_FORMATS):
            lines += ["## Serving through vLLM (`python -m pipeline recommend`)", ""]
            for platform in ("cpu", "gpu"):
                lines += ["```", format_recommendation(recommend(summary, platform)), "```", ""]
        if summary.get("evaluation_llamacpp"):
            from pipeline.recommend import format_llamacpp, recommend_llamacpp
            lines += ["## Serving through llama.cpp (`python -m pipeline recommend --engine llama.cpp`)", "", "```",
                      format_llamacpp(recommend_llamacpp(summary)), "```", ""]
    drift_out = summary.get("drift", {})
    sens = drift_out.get("sensitivity")
    if sens:
        edges = sens["bucket_edges"]
        heatmap(sens["map_kl"], edges, "next-token KL, one layer quantized", run_dir / "heatmap_kl.png", "magma")
        heatmap(sens["map_cos"], edges, "attention-output cosine", run_dir / "heatmap_cos.png", "viridis")
        table = io.StringIO()
        w = csv.writer(table, lineterminator="\r\n")  # the csv module's default, as before
        w.writerow(["layer", "bucket", "kl", "cos"])
        for layer, (kls, coss) in enumerate(zip(sens["map_kl"], sens["map_cos"])):
            for j, (kl, cos) in enumerate(zip(kls, coss)):
                w.writerow([layer, edges[j], f"{kl:.6g}", f"{cos:.6g}"])
        atomic_write_text(run_dir / "layer_position_map.csv", table.getvalue())
        lines += ["## Where the error lands (layer x position)", "", "![kl](heatmap_kl.png) ![cos](heatmap_cos.png)", "",
                  "CSV: `layer_position_map.csv`.", ""]
    # a KL column per sensitivity variant that was computed (sensitivity.variants); the others are left out
    computed = [v for v in ("k", "v", "kv") if sens and v in sens["variants"]]
    titles = {"k": "KL (K only)", "v": "KL (V only)", "kv": "KL (K+V)"}
    header = ["layer", "K", "V", *(titles[v] for v in computed)]
    lines += ["## Layer map", "", "| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
    for i, (pk, pv) in enumerate(target.layers):
        cells = [str(i), f"{pk.format}{pk.bits if pk.format != 'fp16' else ''}",
                 f"{pv.format}{pv.bits if pv.format != 'fp16' else ''}",
                 *(f"{sens['layer_kl'][v][i]:.4g}" for v in computed)]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "## Ledger (bytes per sequence, batch 1)", "", "| tokens | this artifact | fp16 | ratio |", "|---|---|---|---|"]
    expected = [(summary.get("evaluation", {}).get("recipes", {}).get(target.name, {}).get("outlier_fraction_k"),
                 summary.get("evaluation", {}).get("recipes", {}).get(target.name, {}).get("outlier_fraction_v"))] * spec.n_layers
    # sliding-window layers hold at most their window (ledger and fp16 alike)
    windows = spec.layer_windows()
    for t in (1024, 8192, 32768, 131072):
        b = predict_bytes(target, t, spec.n_kv_heads, spec.head_dim, expected=expected, windows=windows)
        rows = sum(t if w is None else min(t, w) for w in windows)
        fp16 = 2 * spec.n_kv_heads * spec.head_dim * rows * 2
        lines.append(f"| {t} | {b:,.0f} | {fp16:,} | {b / fp16:.3f} |")
    probes_out = drift_out.get("probes")
    if probes_out:
        lines += ["", "## Passkey probes", ""]
        for name, cells in probes_out["cells"].items():
            lines.append(f"- {name}: accuracy {probes_out['accuracy'][name]:.2f} -- " +
                         ", ".join(f"{k}:{'ok' if v else 'miss'}" for k, v in cells.items()))
    g = drift_out.get("gate")
    if g:
        lines += ["", f"## Drift gate: {'PASSED' if g['passed'] else 'FAILED'}", "", f"Thresholds: {g['thresholds']}", ""]
        lines += [f"- {f}" for f in g["failures"]]
    if examples:
        lines += ["", "## Changed examples (greedy next token differs from full precision)", ""]
        lines += [f"- pos {e['position']}: `...{e['context']}` -> fp16 `{e['fp16']}`, quantized `{e['quantized']}`"
                  for e in examples]
    check = summary.get("runtime_check")
    if check:
        lines += ["", f"## Runtime check: {check.get('status')}", "", f"{check}"]
    faults.point("report.before_write")
    return atomic_write_text(run_dir / "report.md", "\n".join(lines) + "\n")

