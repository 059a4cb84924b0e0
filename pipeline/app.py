"""One pipeline run: model + windows -> the stage graph -> results in the run directory.

The graph: traces -> fisher -> (per calibration group) key_scales -> outliers -> codebooks -> evaluate.
Smoothed recipes add traces -> smooth (their key stages fit K / lambda); prefix recipes add traces ->
prefix_tokens -> traces-prefix -> fisher-prefix (their key stages fit the rows after the prefix).
Stages are pure (stages/): this module only names them, says which results feed which, and hands the runner
(pipeline/runner.py) the graph; the runner owns caching, timing and files.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path

from exporters.checksums import sha256_json
from exporters.native import update_manifest
from pipeline import analysis, faults
from pipeline.config import QuantConfig, RunConfig, load_recipe
from pipeline.data import build_windows
from pipeline.errors import GateError, RuntimeCheckError, UserError
from pipeline.export import CHECKPOINT_DIR, export, servable, write_vllm_checkpoint
from exporters.files import atomic_write_json
from pipeline.model import LoadedModel, load_model, source_directory
from pipeline.runner import Runner, Stage, peak_rss_mb
from stages import (codebooks, engine_cache, evaluate, fisher, key_scales, outliers, prefix_tokens, recipe,
                    smooth_attention, traces)
from stages.base import StageResult
from stages.calibration_rows import block_mean, rows_for
from stages.hooks import model_rotaries

CALIBRATION_STAGES = ("traces", "fisher", "smooth", "prefix_tokens", "key_scales", "outliers", "codebooks")


@dataclass(frozen=True)
class CalibGroup:
    """Recipes that share key scales, outlier thresholds and codebooks. Smoothed recipes fit K / lambda; prefix
    recipes fit rows of the traces taken with the prefix prepended, the prefix rows excluded."""
    fraction: float
    n_sink: int
    key_rope: str
    smooth: bool = False
    prefix: bool = False
    rotate_k: bool = False   # keys / values rotated before quantizing (codec rotation "hadamard"; evaluation only)
    rotate_v: bool = False

    @property
    def suffix(self) -> str:
        flags = ("-smooth" if self.smooth else "") + ("-prefix" if self.prefix else "")
        flags += ("-rotk" if self.rotate_k else "") + ("-rotv" if self.rotate_v else "")
        return f"f{self.fraction:g}-s{self.n_sink}-{self.key_rope}{flags}"

    @property
    def traces(self) -> str:
        return "traces-prefix" if self.prefix else "traces"

    @property
    def fisher(self) -> str:
        return "fisher-prefix" if self.prefix else "fisher"


def _group(q: QuantConfig) -> CalibGroup:
    return CalibGroup(max(q.key.outlier_fraction, q.value.outlier_fraction), q.n_sink, q.key_rope, q.smooth, q.prefix,
                      q.key.rotation != "none", q.value.rotation != "none")


def recipes_of(cfg: RunConfig) -> list[QuantConfig]:
    """The run's own recipe first, then the comparison recipes (by name, from conf/quant)."""
    out = [cfg.quant]
    names = list(cfg.eval.recipes) + (list(cfg.layer_policy.options) if cfg.layer_policy.enabled else [])
    for name in names:
        if name not in [q.name for q in out]:
            out.append(load_recipe(name))
    return out


def build_stages(cfg: RunConfig, lm: LoadedModel, windows, recipes: list[QuantConfig]) -> list[Stage]:
    spec, model = lm.spec, lm.model
    n_calib = windows.calib.shape[0]
    stages = [Stage("traces", lambda inp, pr: traces.fit(traces.Inputs(model, spec, windows.calib), cfg.traces, pr),
                    config=cfg.traces, units=n_calib)]
    groups: dict[CalibGroup, list[int]] = {}
    for q in recipes:
        if recipe.needs_calibration(q):
            groups.setdefault(_group(q), []).extend(recipe.codebook_bits(q))
    stages += _smooth_and_prefix_stages(cfg, lm, windows, recipes, groups)
    if any(not g.prefix for g in groups):
        stages.append(Stage("fisher", lambda inp, pr: fisher.fit(fisher.Inputs(
            model, spec, windows.calib, inp["traces"].tensors["res_sample"], inp["traces"].tensors["res_pos"]),
            cfg.fisher, pr), config={"loss": "causal-lm-sum"}, deps=["traces"], units=n_calib))
    dtype = next(model.parameters()).dtype
    for g, bits in groups.items():
        ks, ol, cb = (f"{name}-{g.suffix}" for name in ("key_scales", "outliers", "codebooks"))
        extra = (["smooth"] if g.smooth else []) + (["prefix_tokens"] if g.prefix else [])
        bits = sorted(set(bits))

        def rows(inp, g, with_fisher=False):
            n_sink = g.n_sink
            if g.prefix:  # the whole prefix is kept in full precision, like sink rows
                n_sink = max(n_sink, int(inp["prefix_tokens"].tensors["ids"].numel()))
            return rows_for(inp[g.traces].tensors, g.key_rope, model_rotaries(model), dtype, n_sink,
                            smooth=inp["smooth"].tensors["smooth"] if g.smooth else None,
                            fisher=inp[g.fisher].tensors if with_fisher else None,
                            rotate_k=g.rotate_k, rotate_v=g.rotate_v)

        def fit_scales(inp, pr, g=g):
            return key_scales.fit(rows(inp, g), key_scales.KeyScalesConfig(outlier_fraction=g.fraction))

        def fit_outliers(inp, pr, g=g, ks=ks):
            s = inp[ks].tensors
            return outliers.fit(outliers.Inputs(rows(inp, g), s["lower"], s["upper"]),
                                outliers.OutliersConfig(fraction=g.fraction))

        def fit_codebooks(inp, pr, g=g, ks=ks, bits=bits):
            query_w = None
            if cfg.codebooks.weighting == "query-scale2":  # keys weighted by the queries that read them
                query_w = codebooks.query_key_weights(inp[g.traces].tensors["q_meansq"], spec.n_kv_heads,
                                                      spec.rope_pairing)
                if g.smooth:  # the cache stores K / lambda: an error there is lambda times larger on K
                    query_w = query_w * inp["smooth"].tensors["smooth"].square()
                if g.rotate_k:  # rotated keys: each rotated channel mixes its whole Hadamard block
                    query_w = block_mean(query_w)
            return codebooks.fit(codebooks.Inputs(rows(inp, g, with_fisher=True), inp[ks].tensors, g.fraction, bits,
                                                  query_w), cfg.codebooks)

        group_cfg = {"fraction": g.fraction, "n_sink": g.n_sink, "rope": g.key_rope}
        if g.rotate_k or g.rotate_v:  # only then: the unrotated groups' cache keys stay as they were
            group_cfg["rotate"] = {"k": g.rotate_k, "v": g.rotate_v}
        stages += [Stage(ks, fit_scales, group_cfg, deps=[g.traces, *extra]),
                   Stage(ol, fit_outliers, group_cfg, deps=[g.traces, ks, *extra]),
                   Stage(cb, fit_codebooks, {**group_cfg, "bits": bits, "cfg": cfg.codebooks},
                         deps=[g.traces, g.fisher, ks, *extra])]
    if cfg.eval.enabled:
        deps = [s.name for s in stages]

        def run_eval(inp, pr):
            policies = [recipe.build_policy(q, spec.n_layers, calibration_tensors(q, inp)) for q in recipes]
            return evaluate.fit(evaluate.Inputs(model, spec, windows.eval, policies), cfg.eval, pr)

        stages.append(Stage("evaluate", run_eval, config={"recipes": [q for q in recipes]}, deps=deps,
                            units=windows.eval.shape[0]))
    return stages


def _smooth_and_prefix_stages(cfg: RunConfig, lm: LoadedModel, windows, recipes: list[QuantConfig],
                              groups: dict[CalibGroup, list[int]]) -> list[Stage]:
    """smooth (lambda from the plain traces), prefix_tokens (discovered on the plain traces), and for calibrated
    prefix recipes a second traces + fisher run on the calibration windows with the prefix prepended."""
    spec, model, n_calib, out = lm.spec, lm.model, windows.calib.shape[0], []
    if any(q.smooth for q in recipes):
        smooth_attention.validate(cfg.smooth)
        out.append(Stage("smooth", lambda inp, pr: smooth_attention.fit(smooth_attention.Inputs(
            inp["traces"].tensors["q_absmax"], inp["traces"].tensors["k_pre_absmax"], spec.rope_pairing), cfg.smooth),
            config=cfg.smooth, deps=["traces"]))
    if not any(q.prefix for q in recipes):
        return out
    prefix_tokens.validate(cfg.prefix, min(cfg.traces.down_top_k, windows.calib.shape[1]))
    if spec.bos_token_id is None:
        raise UserError(f"quant.prefix=true: the tokenizer of model {spec.name} has no BOS token "
                         f"(bos_token_id is None), and the prefix ends in BOS")
    out.append(Stage("prefix_tokens",
                     lambda inp, pr: prefix_tokens.fit(prefix_tokens.Inputs(model, spec, inp["traces"].tensors),
                                                       cfg.prefix),
                     config={**asdict(cfg.prefix), "tokenizer_sha256": spec.tokenizer_sha256}, deps=["traces"]))
    if any(g.prefix for g in groups):
        def served(inp):
            return prefix_tokens.prepend(inp["prefix_tokens"].tensors["ids"], windows.calib)

        out.append(Stage("traces-prefix", lambda inp, pr: traces.fit(traces.Inputs(model, spec, served(inp)),
                                                                      cfg.traces, pr),
                         config=cfg.traces, deps=["prefix_tokens"], units=n_calib))
        out.append(Stage("fisher-prefix", lambda inp, pr: fisher.fit(fisher.Inputs(
            model, spec, served(inp), inp["traces-prefix"].tensors["res_sample"],
            inp["traces-prefix"].tensors["res_pos"]), cfg.fisher, pr),
            config={"loss": "causal-lm-sum"}, deps=["prefix_tokens", "traces-prefix"], units=n_calib))
    return out


def calibration_tensors(q: QuantConfig, inp: dict[str, StageResult]) -> dict[str, torch.Tensor]:
    """The stage results a recipe's policy is built from, by the names recipe.build_policy reads."""
    t = inp["traces"].tensors
    out = {"k_absmax": t["k_post_absmax"] if q.key_rope == "post" else t["k_pre_absmax"], "v_absmax": t["v_absmax"]}
    if q.smooth:  # the cache holds K / lambda; lambda is per channel, so its abs-max divides exactly
        out["smooth"] = inp["smooth"].tensors["smooth"]
        out["k_absmax"] = out["k_absmax"] / out["smooth"]
    if q.prefix:
        out["prefix_ids"] = inp["prefix_tokens"].tensors["ids"]
    if recipe.needs_calibration(q):
        suffix = _group(q).suffix
        out.update(inp[f"key_scales-{suffix}"].tensors)
        out.update(inp[f"codebooks-{suffix}"].tensors)
    return out


def model_identity(lm: LoadedModel) -> str:
    """What of the model a stage result depends on: weights and config (model_sha256), the tokenizer (probe
    prompts are tokenized inside the graph), and the dtype and device the weights were loaded to (model_sha256
    hashes the weight file, which is the same for float32 and bfloat16 loads)."""
    param = next(lm.model.parameters())
    return sha256_json({"model": lm.spec.model_sha256, "tokenizer": lm.spec.tokenizer_sha256,
                        "dtype": str(param.dtype), "device": param.device.type})


def check_recipes(cfg: RunConfig) -> list[QuantConfig]:
    """The run's recipes (recipes_of), each valid, and the ones it exports and serves -- its own (quant=...) and
    the layer_policy options -- in formats the artifact takes: refused before the model loads or any stage runs.
    Evaluation-only formats (vLLM's own caches) are evaluated only beside the run's recipe, via eval.recipes."""
    recipes = recipes_of(cfg)
    for q in recipes:
        recipe.validate_recipe(q)
    recipe.check_exportable_recipe(cfg.quant, "quant")
    if cfg.layer_policy.enabled:
        by_name = {q.name: q for q in recipes}
        for i, name in enumerate(cfg.layer_policy.options):
            recipe.check_exportable_recipe(by_name[name], f"layer_policy.options[{i}] (recipe {name}): quant")
    return recipes


def run_pipeline(cfg: RunConfig, run_dir: Path, log=print, show_progress: bool = True) -> dict:
    start = time.perf_counter()
    recipes = check_recipes(cfg)  # refuse a bad recipe before anything loads
    lm = load_model(cfg.model)
    for q in recipes:
        if q.engine.library:
            engine_cache.check_model(q.name, lm.spec.name, lm.spec.layer_types)
    windows = build_windows(cfg.data, lm.tokenizer)
    if cfg.gate.enabled and not cfg.eval.enabled:  # the gate judges the evaluation: never skip it silently
        raise UserError("gate.enabled=true needs eval.enabled=true (the gate judges the evaluation's perplexity "
                        "ratio); got eval.enabled=false: set gate.enabled=false too, or enable the evaluation")
    codebooks.check_weighting(cfg.codebooks.weighting)
    data_id = sha256_json([windows.calib_sha256, windows.eval_sha256])
    runner = Runner(cfg.cache_dir, model_identity(lm), data_id, log=log, show_progress=show_progress)
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
    target = recipe.build_policy(cfg.quant, lm.spec.n_layers, calibration_tensors(cfg.quant, results))
    if cfg.layer_policy.enabled:  # the artifact becomes the mixed per-layer policy
        by_name = {q.name: q for q in recipes}
        options = {n: recipe.build_policy(by_name[n], lm.spec.n_layers, calibration_tensors(by_name[n], results))
                   for n in cfg.layer_policy.options}
        target, summary["mixed"] = analysis.select_policy(cfg, lm, windows, runner, results, options)
        summary["evaluation"]["recipes"][target.name] = summary["mixed"]["recipe"]
    if "evaluate" in results:
        summary["drift"] = analysis.drift(cfg, lm, windows, runner, results, target)
    if cfg.export.enabled:
        provenance = {"data": summary["data"],
                      "stages": {r.name: {"cache_key": r.key, "config_sha256": r.config_sha256} for r in runner.records}}
        prefix = None
        if cfg.quant.prefix and "prefix_tokens" in results:  # the full-precision prefix K/V ship with the artifact
            pt = results["prefix_tokens"].tensors
            prefix = {"token_ids": pt["ids"].tolist(), "k": pt["k_post"], "v": pt["v"]}
        summary.update(export(run_dir, target, lm.spec, provenance,
                              summary.get("evaluation", {}).get("recipes", {}), prefix=prefix,
                              overwrite=cfg.export.overwrite))
        if cfg.check.enabled:  # kernel vs oracle on the exported artifact; the manifest records the outcome
            from pipeline.check import run_check
            summary["runtime_check"] = run_check(summary["artifact_dir"], lm, cfg.check, log=log)
        if "gate" in summary.get("drift", {}):
            faults.point("export.before_update_manifest")
            update_manifest(summary["artifact_dir"], gate=summary["drift"]["gate"])
        served_ok = (summary.get("runtime_check", {}).get("status", "passed") == "passed"
                     and summary.get("drift", {}).get("gate", {}).get("passed", True))
        if cfg.export.vllm and servable(target) and served_ok:  # a folder ready to serve: only what passed
            checkpoint = write_vllm_checkpoint(run_dir / CHECKPOINT_DIR, Path(summary["artifact_dir"]), lm,
                                               source_directory(cfg.model), overwrite=cfg.export.overwrite)
            summary["vllm_checkpoint_dir"] = str(checkpoint.resolve())
    if "evaluate" in results:
        examples = analysis.changed_examples(lm, windows.eval[0], target)
        summary["report"] = str(analysis.write_report(run_dir, summary, target, lm.spec, examples))
    summary["stages"] = [dict(r.__dict__) for r in runner.records]  # with the stages run after calibration
    faults.point("summary.before_write")
    atomic_write_json(run_dir / "summary.json", summary)
    log(runner.table())
    if "evaluation" in summary:
        log(evaluate.table(summary["evaluation"]["recipes"]))
    gate_result = summary.get("drift", {}).get("gate")
    if gate_result:
        log(f"drift gate: {'passed' if gate_result['passed'] else 'FAILED'}"
            + "".join(f"\n  {f}" for f in gate_result["failures"]))
    if summary.get("report"):
        log(f"report: {summary['report']}")
    if summary.get("runtime_check", {}).get("status") == "failed":  # after the manifest and summary record it
        raise RuntimeCheckError(summary["artifact_dir"], summary["runtime_check"])
    if gate_result and not gate_result["passed"]:
        raise GateError(f"drift gate failed for {target.name}: " + "; ".join(gate_result["failures"][:5]),
                        {"summary": summary, "results": results, "runner": runner, "model": lm, "windows": windows})
    return {"summary": summary, "results": results, "runner": runner, "model": lm, "windows": windows}
