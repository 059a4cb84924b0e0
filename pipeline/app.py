"""One pipeline run: model + windows -> the stage graph -> results in the run directory.

The graph: traces -> fisher -> (per outlier fraction) key_scales -> outliers -> codebooks -> evaluate.
Stages are pure (stages/); this module only wires them, and the runner owns caching, timing and files.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from exporters.rope import apply_rope
from pipeline.config import QuantConfig, RunConfig, load_recipe
from pipeline.data import build_windows
from pipeline.hashing import sha256_json
from pipeline.model import LoadedModel, load_model
from pipeline.runner import Runner, Stage, peak_rss_mb
from stages import codebooks, evaluate, fisher, key_scales, outliers, policy, traces
from stages.base import StageResult
from stages.evaluate import rope_tables

CALIBRATION_STAGES = ("traces", "fisher", "key_scales", "outliers", "codebooks")


@dataclass(frozen=True)
class CalibGroup:
    """Recipes that share key scales, outlier thresholds and codebooks."""
    fraction: float
    n_sink: int
    key_rope: str

    @property
    def suffix(self) -> str:
        return f"f{self.fraction:g}-s{self.n_sink}-{self.key_rope}"


def _group(q: QuantConfig) -> CalibGroup:
    return CalibGroup(max(q.key.outlier_fraction, q.value.outlier_fraction), q.n_sink, q.key_rope)


def recipes_of(cfg: RunConfig) -> list[QuantConfig]:
    """The run's own recipe first, then the comparison recipes (by name, from conf/quant)."""
    out = [cfg.quant]
    for name in cfg.eval.recipes:
        if name != cfg.quant.name:
            out.append(load_recipe(name))
    return out


def calibration_keys(res: StageResult, lm: LoadedModel, key_rope: str) -> torch.Tensor:
    """Reservoir key rows in the space the recipe quantizes: pre-RoPE as recorded, or rotated to post-RoPE."""
    k = res.tensors["res_k"]
    if key_rope == "pre":
        return k
    pos = res.tensors["res_pos"]
    tables = rope_tables(lm.model, torch.zeros(1, int(pos.max()) + 1, dtype=torch.long))
    cos, sin = tables["cos"][0, pos], tables["sin"][0, pos]  # [S, D]
    s, n_layers, h, d = k.shape
    rows = k.permute(1, 2, 0, 3).reshape(1, n_layers * h, s, d)  # rows as a [1, L*H, S, D] "sequence"
    rot = apply_rope(rows, cos, sin)
    return rot.view(n_layers, h, s, d).permute(2, 0, 1, 3).contiguous()


def build_stages(cfg: RunConfig, lm: LoadedModel, windows, recipes: list[QuantConfig]) -> list[Stage]:
    spec = lm.spec
    n_calib = windows.calib.shape[0]
    stages = [Stage("traces", lambda inp, pr: traces.fit(lm.model, spec, windows.calib, cfg.traces, pr),
                    config=cfg.traces, units=n_calib)]
    calibrated = [q for q in recipes if policy.needs_calibration(q)]
    groups: dict[CalibGroup, list[int]] = {}
    for q in calibrated:
        bits = groups.setdefault(_group(q), [])
        bits += [b for b in (q.key.bits, q.value.bits) if b not in bits]
    if calibrated:
        stages.append(Stage("fisher", lambda inp, pr: fisher.fit(
            lm.model, spec, windows.calib, inp["traces"].tensors["res_sample"], inp["traces"].tensors["res_pos"], pr),
            config={"loss": "causal-lm-sum"}, deps=["traces"], units=n_calib))
    for g, bits in groups.items():
        ks, ol, cb = (f"{name}-{g.suffix}" for name in ("key_scales", "outliers", "codebooks"))
        ks_cfg = key_scales.KeyScalesConfig(outlier_fraction=g.fraction, n_sink=g.n_sink)
        cb_cfg = codebooks.CodebookConfig(bits=sorted(bits), n_bins=cfg.codebooks.n_bins,
                                          lloyd_check=cfg.codebooks.lloyd_check)

        def fit_scales(inp, pr, g=g, ks_cfg=ks_cfg):
            t = inp["traces"].tensors
            return key_scales.fit(calibration_keys(inp["traces"], lm, g.key_rope), t["res_pos"], ks_cfg)

        def fit_outliers(inp, pr, g=g, ks=ks):
            t, s = inp["traces"].tensors, inp[ks].tensors
            return outliers.fit(calibration_keys(inp["traces"], lm, g.key_rope), t["res_v"], t["res_pos"],
                                s["lower"], s["upper"], g.fraction, g.n_sink)

        def fit_codebooks(inp, pr, g=g, ks=ks, cb_cfg=cb_cfg):
            t, f = inp["traces"].tensors, inp["fisher"].tensors
            return codebooks.fit(calibration_keys(inp["traces"], lm, g.key_rope), t["res_v"], f["fisher_k"],
                                 f["fisher_v"], t["res_pos"], inp[ks].tensors, g.fraction, g.n_sink, cb_cfg)

        stages += [Stage(ks, fit_scales, ks_cfg, deps=["traces"]),
                   Stage(ol, fit_outliers, {"fraction": g.fraction, "n_sink": g.n_sink, "rope": g.key_rope},
                         deps=["traces", ks]),
                   Stage(cb, fit_codebooks, cb_cfg, deps=["traces", "fisher", ks])]
    if cfg.eval.enabled:
        deps = [s.name for s in stages]

        def run_eval(inp, pr):
            policies = [policy.build(q, spec.n_layers, calibration_tensors(q, inp)) for q in recipes]
            return evaluate.fit(lm.model, spec, windows.eval, policies, pr)

        stages.append(Stage("evaluate", run_eval, config={"recipes": [q for q in recipes]}, deps=deps,
                            units=windows.eval.shape[0]))
    return stages


def calibration_tensors(q: QuantConfig, inp: dict[str, StageResult]) -> dict[str, torch.Tensor]:
    t = inp["traces"].tensors
    out = {"k_absmax": t["k_post_absmax"] if q.key_rope == "post" else t["k_pre_absmax"], "v_absmax": t["v_absmax"]}
    if policy.needs_calibration(q):
        suffix = _group(q).suffix
        out.update(inp[f"key_scales-{suffix}"].tensors)
        out.update(inp[f"codebooks-{suffix}"].tensors)
    return out


def run_pipeline(cfg: RunConfig, run_dir: Path, log=print, show_progress: bool = True) -> dict:
    start = time.perf_counter()
    lm = load_model(cfg.model)
    windows = build_windows(cfg.data, lm.tokenizer)
    recipes = recipes_of(cfg)
    for q in recipes:  # refuse a bad recipe before any stage runs
        policy._validate_recipe(q)
    data_id = sha256_json([windows.calib_sha256, windows.eval_sha256])
    runner = Runner(cfg.cache_dir, lm.spec.model_sha256, data_id, log=log, show_progress=show_progress)
    results: dict[str, StageResult] = runner.run(build_stages(cfg, lm, windows, recipes))
    calib_wall = sum(r.wall_s for r in runner.records if r.name.split("-")[0] in CALIBRATION_STAGES)
    summary = {
        "recipe": cfg.quant.name,
        "model": lm.spec.to_dict(),
        "data": {"description": windows.description, "calib_sha256": windows.calib_sha256,
                 "eval_sha256": windows.eval_sha256, "n_samples": cfg.data.n_samples, "seq_len": cfg.data.seq_len,
                 "seed": cfg.data.seed, "eval_n_samples": cfg.data.eval_n_samples,
                 "eval_seq_len": cfg.data.eval_seq_len},
        "stages": [r.__dict__ for r in runner.records],
        "stage_meta": {name: res.meta for name, res in results.items() if name != "evaluate"},
        "calib_wall_s": calib_wall,
        "wall_s": time.perf_counter() - start,
        "peak_rss_mb": peak_rss_mb(),
    }
    if "evaluate" in results:
        summary["evaluation"] = results["evaluate"].meta
    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = run_dir / "summary.json.tmp"
    tmp.write_text(json.dumps(summary, indent=1, default=str))
    tmp.replace(run_dir / "summary.json")
    log(runner.table())
    if "evaluation" in summary:
        log(evaluate.table(summary["evaluation"]["recipes"]))
    return {"summary": summary, "results": results, "runner": runner, "model": lm, "windows": windows}
