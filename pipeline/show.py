"""`python -m pipeline show DIR`: an artifact's summary and lineage, read only through the strict loader.

Whatever the schema lets a manifest hold is printed, never a crash: every field the schema leaves optional may be
absent, numbers may be huge (an integer beyond a float), null, NaN or infinite, and text (names, descriptions,
stage names) may hold control characters, terminal escapes, unpaired surrogates or megabytes; every string of the
manifest is printed through pipeline.errors.shown (its unprintable characters escaped, cut to MAX_SHOWN_CHARS
characters; paths to PATH_MAX), numbers through _num.
"""
from __future__ import annotations

from collections import Counter
from pathlib import Path

from exporters.native import load_artifact
from pipeline.errors import PATH_MAX, shown
from pipeline.sanity import warnings


def _num(value, spec: str) -> str:
    """A JSON number formatted by `spec`; None as "n/a"; an integer beyond a float (or any value the format refuses)
    as its own digits, cut as text is."""
    if value is None:
        return "n/a"
    try:
        return format(value, spec)
    except (OverflowError, ValueError, TypeError):
        return shown(value, 40)


def _ratio(a, b) -> float | None:
    """a / b of two JSON numbers, None when b is 0 or the quotient is beyond a float."""
    try:
        return a / b if b else None
    except (OverflowError, TypeError, ZeroDivisionError):
        return None


def _describe(p: dict) -> str:
    """A layer's key or value policy in one line (printed through shown: every member is the manifest's)."""
    out = f"{p['format']}"
    if p["format"] in ("uniform", "nuq"):
        out += f"{p['bits']} per-{p['axis']}"
        if p["group_size"]:
            out += f" g{p['group_size']}"
    elif p["format"] == "fp8":
        out += f"-{p.get('fp8_dtype', 'e4m3')} per-{p['axis']}"
    if p["outliers"]["fraction"]:
        out += f" +{_num(100 * p['outliers']['fraction'], 'g')}% sparse"
    if p.get("rotation"):
        out += " rotated"
    if p.get("clip"):
        out += f" clip {p['clip']}"
    return out


def _source(source: dict | None) -> list[str]:
    """Where the artifact's model was loaded from (manifest model.source; none in artifacts made before it)."""
    if not source:
        return []
    revision = f", revision {shown(source['revision'])}" if source.get("revision") else ""
    path = f" {shown(source['path'], PATH_MAX)}" if source.get("path") else ""
    return [f"source     {shown(source['kind'])}{path}{revision} (config {shown(source['config'])})"]


def _evaluation(m: dict) -> list[str]:
    """The recipe's own evaluation (every field optional in the schema), against fp16's perplexity when recorded."""
    ev = m["evaluation"].get(m["recipe"])
    if not ev:
        return []
    ratio = _ratio(ev.get("ppl"), m["evaluation"].get("fp16", {}).get("ppl"))
    vs_fp16 = f" ({_num(ratio, '.4f')} x fp16)" if ratio is not None else ""
    return [f"evaluation ppl {_num(ev.get('ppl'), '.3f')}{vs_fp16}, KL {_num(ev.get('kl'), '.4f')}, top-1 "
            f"{_num(ev.get('top1'), '.4f')}, avg bits {_num(ev.get('avg_bits'), '.3f')}"]


def _sanity(m: dict) -> list[str]:
    """The model's own sanity (pipeline.sanity), judged from the manifest's evaluation (its fp16 row's perplexity,
    or any row's ppl / ppl_ratio) and its model's vocab_size; nothing where either is not recorded (vocab_size: not
    in artifacts made before it)."""
    return [f"warning    {shown(w, PATH_MAX)}" for w in warnings(m["evaluation"], m["model"].get("vocab_size"))]


def _check(check: dict | None) -> str:
    """The runtime check the artifact records: its status, worst error (null when no case ran), tolerance and error;
    the quality canary on a line of its own when the record has one. Printed as what it is -- the artifact's claim,
    which whoever wrote the file can rewrite and re-sign -- with the command that measures it."""
    if check is None:
        return "check      not run (claimed by the artifact; `kvcalib check ARTIFACT` measures it)"
    tol = check["tolerance"]
    line = (f"check      {shown(check['status'])} (max abs err {_num(check.get('max_abs_err'), '.2e')}, tolerance "
            f"atol {_num(tol.get('atol'), 'g')} rtol {_num(tol.get('rtol'), 'g')})")
    line += f": {shown(check['error'])}" if check.get("error") else ""
    line += "\n           claimed by the artifact, not a result: `kvcalib check ARTIFACT` measures it"
    canary = check.get("canary")
    if canary:  # the quality canary (runtime_check/canary.py; docs/manifest.md)
        line += (f"\ncanary     claimed {'ok' if canary['ok'] else 'FAILED'}: KL {_num(canary.get('kl'), '.3g')} nats over "
                 f"{shown(canary['tokens'])} tokens, top-1 agreement {_num(canary.get('agreement'), '.3f')}; "
                 f"calibration-free baseline KL {_num(canary.get('baseline_kl'), '.3g')}, limit "
                 f"{_num(canary.get('limit'), '.3g')} (re-measured by `kvcalib check`)")
    return line


def show_artifact(directory: str | Path) -> str:
    a = load_artifact(directory)
    m = a.manifest
    model, cache, creator = m["model"], m["cache"], m["creator"]
    lines = [f"artifact   {shown(Path(directory).resolve(), PATH_MAX)}",
             f"format     {shown(m['format'])} v{m['format_version']}  created {shown(m['created'])} by "
             f"{shown(creator['package'])} {shown(creator['version'])} (git {shown(creator['git_sha'][:12])})",
             f"model      {shown(model['name'])} {shown(model['architecture'])}: {model['n_layers']} layers, "
             f"{model['n_q_heads']} q heads, {model['n_kv_heads']} kv heads, head_dim {model['head_dim']}, RoPE theta "
             f"{_num(model['rope']['theta'], 'g')} ({shown(model['rope']['pairing'])}) sha256 "
             f"{shown(model['sha256'][:16])}",
             *_source(model.get("source")),
             f"tokenizer  sha256 {shown(m['tokenizer']['sha256'][:16])}",
             f"recipe     {shown(m['recipe'])}: keys {shown(cache['key_rope'])}-RoPE, sink rows {cache['n_sink']}, "
             f"residual {cache['residual']}, smoothing {'yes' if cache['smoothing'] else 'no'}, prefix "
             f"{len(cache['prefix']['token_ids']) if cache['prefix'] else 0} tokens"]
    per_layer = Counter((_describe(layer["key"]), _describe(layer["value"])) for layer in m["layers"])
    for (k, v), n in per_layer.items():
        lines.append(f"layers     {n:>3} x  K {shown(k):<28} V {shown(v)}")
    lines += _sanity(m) + _evaluation(m)
    lines.append(_check(m["runtime_check"]))
    data = m["calibration"].get("data", {})
    lines.append(f"data       {shown(data.get('description'))}: {shown(data.get('n_samples'), 40)} x "
                 f"{shown(data.get('seq_len'), 40)} tokens, seed {shown(data.get('seed'), 40)}, windows sha256 "
                 f"{shown(str(data.get('calib_sha256'))[:16])}")
    for name, st in m["calibration"].get("stages", {}).items():
        lines.append(f"stage      {shown(name):<28} cache key {shown(st['cache_key'][:12])}  config sha256 "
                     f"{shown(st['config_sha256'][:12])}")
    return "\n".join(lines)
