"""`python -m pipeline show DIR`: an artifact's summary and lineage, read only through the strict loader."""
from __future__ import annotations

from collections import Counter
from pathlib import Path

from exporters.native import load_artifact


def _describe(p: dict) -> str:
    out = f"{p['format']}"
    if p["format"] in ("uniform", "nuq"):
        out += f"{p['bits']} per-{p['axis']}"
        if p["group_size"]:
            out += f" g{p['group_size']}"
    elif p["format"] == "fp8":
        out += f"-{p.get('fp8_dtype', 'e4m3')} per-{p['axis']}"
    if p["outliers"]["fraction"]:
        out += f" +{100 * p['outliers']['fraction']:g}% sparse"
    return out


def _source(source: dict | None) -> list[str]:
    """Where the artifact's model was loaded from (manifest model.source; none in artifacts made before it)."""
    if not source:
        return []
    revision = f", revision {source['revision']}" if source.get("revision") else ""
    path = f" {source['path']}" if source.get("path") else ""
    return [f"source     {source['kind']}{path}{revision} (config {source['config']})"]


def show_artifact(directory: str | Path) -> str:
    a = load_artifact(directory)
    m = a.manifest
    model, cache = m["model"], m["cache"]
    lines = [f"artifact   {Path(directory).resolve()}",
             f"format     {m['format']} v{m['format_version']}  created {m['created']} by {m['creator']['package']} "
             f"{m['creator']['version']} (git {m['creator']['git_sha'][:12]})",
             f"model      {model['name']} {model['architecture']}: {model['n_layers']} layers, {model['n_q_heads']} q heads, "
             f"{model['n_kv_heads']} kv heads, head_dim {model['head_dim']}, RoPE theta {model['rope']['theta']:g} "
             f"({model['rope']['pairing']}) sha256 {model['sha256'][:16]}",
             *_source(model.get("source")),
             f"tokenizer  sha256 {m['tokenizer']['sha256'][:16]}",
             f"recipe     {m['recipe']}: keys {cache['key_rope']}-RoPE, sink rows {cache['n_sink']}, residual {cache['residual']}, "
             f"smoothing {'yes' if cache['smoothing'] else 'no'}, prefix "
             f"{len(cache['prefix']['token_ids']) if cache['prefix'] else 0} tokens"]
    per_layer = Counter((_describe(layer["key"]), _describe(layer["value"])) for layer in m["layers"])
    for (k, v), n in per_layer.items():
        lines.append(f"layers     {n:>3} x  K {k:<28} V {v}")
    ev = m["evaluation"].get(m["recipe"])
    if ev:
        ref = m["evaluation"].get("fp16", {}).get("ppl")
        ratio = f" ({ev['ppl'] / ref:.4f} x fp16)" if ref else ""
        lines.append(f"evaluation ppl {ev['ppl']:.3f}{ratio}, KL {ev['kl']:.4f}, top-1 {ev['top1']:.4f}, "
                     f"avg bits {ev['avg_bits']:.3f}")
    check = m["runtime_check"]
    lines.append(f"check      {'not run' if check is None else check['status']}"
                 + (f" (max abs err {check.get('max_abs_err', float('nan')):.2e}, tolerance {check.get('tolerance')})" if check else ""))
    cal = m["calibration"]
    data = cal.get("data", {})
    lines.append(f"data       {data.get('description')}: {data.get('n_samples')} x {data.get('seq_len')} tokens, seed "
                 f"{data.get('seed')}, windows sha256 {str(data.get('calib_sha256'))[:16]}")
    for name, st in cal.get("stages", {}).items():
        lines.append(f"stage      {name:<28} cache key {st['cache_key'][:12]}  config sha256 {st['config_sha256'][:12]}")
    return "\n".join(lines)
