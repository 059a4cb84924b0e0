"""One pipeline run: model + windows -> the stage graph -> results in the run directory.

The graph (stage_graph): traces -> fisher -> (per calibration group) key_scales -> outliers -> codebooks ->
evaluate-reference -> evaluate-recipe-<name> per recipe -> evaluate -> [sensitivity-calib per option ->
evaluate-mixed] -> [evaluate-long: data.long_n_samples] -> sensitivity, probes. Smoothed recipes add traces ->
smooth (their key stages fit K / lambda); prefix recipes add traces -> prefix_tokens -> traces-prefix ->
fisher-prefix (their key stages fit the rows after the prefix). Each stage is declared once in its module
(stages.base.Declaration: name, config dataclass, inputs, fit); this module only lists the declarations bound to
the run's configs; the runner (pipeline/runner.py) computes every key from the whole config and owns caching,
timing and files.
"""
from __future__ import annotations

import time
from pathlib import Path

from exporters.checksums import sha256_file, sha256_json
from exporters.native import update_manifest
from pipeline import analysis, faults, sanity
from pipeline.config import QuantConfig, RunConfig, validate_run
from pipeline.data import build_windows
from pipeline.errors import GateError, RuntimeCheckError, UserError
from pipeline.export import CHECKPOINT_DIR, export, servable, write_vllm_checkpoint
from exporters.files import atomic_write_json
from pipeline.model import LoadedModel, load_model, source_directory
from pipeline.runner import Runner, Usage, peak_rss_mb
from stages import (codebooks, engine_cache, evaluate, evaluate_long, fisher, key_scales, layer_policy, outliers, prefix_tokens,
                    probes, recipe, sensitivity, smooth_attention, traces)
from stages.base import Bound, Context, StageResult
from stages.calibration_rows import CalibGroup

CALIBRATION_STAGES = ("traces", "fisher", "smooth", "prefix_tokens", "key_scales", "outliers", "codebooks")

# every stage the graph can hold, each declared once in its module (stages.base.Declaration)
DECLARATIONS = (traces.STAGE, traces.PREFIXED, fisher.STAGE, fisher.PREFIXED, smooth_attention.STAGE,
                prefix_tokens.STAGE, key_scales.STAGE, outliers.STAGE, codebooks.STAGE, evaluate.REFERENCE,
                evaluate.RECIPE, evaluate.STAGE, evaluate_long.STAGE, sensitivity.STAGE, layer_policy.MIXED,
                probes.STAGE)


def target_of(cfg: RunConfig, recipes: list[QuantConfig]) -> layer_policy.Target:
    """What the run exports and its diagnostics judge: its recipe, or the mixed per-layer policy."""
    if not cfg.layer_policy.enabled:
        return layer_policy.Target(cfg.quant)
    by_name = {q.name: q for q in recipes}
    return layer_policy.Target(cfg.quant, [by_name[n] for n in cfg.layer_policy.options])


def evaluated_recipes(cfg: RunConfig, recipes: list[QuantConfig]) -> list[QuantConfig]:
    """The recipes evaluated alone: all of the run's, but the per-layer policy's options when
    layer_policy.evaluate_options=false (they are calibrated all the same; the choice never reads their rows)."""
    lp = cfg.layer_policy
    if not lp.enabled or lp.evaluate_options:
        return recipes
    named = {cfg.quant.name, *cfg.eval.recipes}
    return [q for q in recipes if q.name in named]


def stage_graph(cfg: RunConfig, recipes: list[QuantConfig]) -> list[Bound]:
    """The run's stage graph: declared stages bound to their configs, inputs before the stages that read them.
    Pure: no model, no data (the runner computes every key from this list alone; Runner.keys_of)."""
    groups: dict[CalibGroup, list[int]] = {}
    for q in recipes:
        if recipe.needs_calibration(q):
            groups.setdefault(recipe.group_of(q), []).extend(recipe.codebook_bits(q))
    graph = [traces.STAGE(cfg.traces)]
    if any(q.smooth for q in recipes):
        graph.append(smooth_attention.STAGE(cfg.smooth))
    if any(q.prefix for q in recipes):
        graph.append(prefix_tokens.STAGE(cfg.prefix))
    if any(g.prefix for g in groups):  # calibrated prefix recipes fit rows taken with the prefix prepended
        graph += [traces.PREFIXED(cfg.traces), fisher.PREFIXED(cfg.fisher)]
    if any(not g.prefix for g in groups):
        graph.append(fisher.STAGE(cfg.fisher))
    for g, bits in groups.items():
        graph += [key_scales.STAGE(g), outliers.STAGE(g),
                  codebooks.STAGE(codebooks.CodebookJob(g, sorted(set(bits)), cfg.codebooks))]
    if not cfg.eval.enabled:
        return graph
    # the reference once, each recipe against it in a stage (and a cache entry) of its own, then the table
    graph.append(evaluate.REFERENCE(evaluate.ReferenceJob()))
    evaluated = evaluated_recipes(cfg, recipes)
    graph += [evaluate.RECIPE(evaluate.recipe_job(cfg.eval, q)) for q in evaluated]
    graph.append(evaluate.STAGE(evaluate.EvaluateJob(cfg.eval, evaluated)))
    target = target_of(cfg, recipes)
    if target.options:  # the per-layer sensitivity of each option on calibration windows, then the allocation
        lp = cfg.layer_policy
        per_option = sensitivity.SensitivityConfig(n_windows=lp.n_windows, seq_len=0, buckets=[0], variants=["kv"])
        graph += [sensitivity.STAGE(sensitivity.SensitivityJob(per_option, layer_policy.Target(q), "calib"))
                  for q in target.options]
        graph.append(layer_policy.MIXED(layer_policy.MixedJob(lp, cfg.eval, target.options)))
    if cfg.data.long_n_samples:  # every recipe (and the mixed policy) again on the long-context windows
        graph.append(evaluate_long.STAGE(evaluate_long.LongJob(cfg.eval, evaluated, target)))
    if cfg.sensitivity.enabled:
        graph.append(sensitivity.STAGE(sensitivity.SensitivityJob(cfg.sensitivity, target)))
    if cfg.probes.enabled:
        graph.append(probes.STAGE(probes.ProbeJob(cfg.probes, target)))
    return graph


def model_identity(lm: LoadedModel) -> str:
    """What of the model a stage result depends on: weights and config (model_sha256), the tokenizer (probe
    prompts are tokenized inside the graph), and the dtype and device the weights were loaded to (model_sha256
    hashes the weight file, which is the same for float32 and bfloat16 loads)."""
    param = next(lm.model.parameters())
    return sha256_json({"model": lm.spec.model_sha256, "tokenizer": lm.spec.tokenizer_sha256,
                        "dtype": str(param.dtype), "device": param.device.type})


def run_pipeline(cfg: RunConfig, run_dir: Path, log=print, show_progress: bool = True) -> dict:
    start = time.perf_counter()
    recipes = validate_run(cfg)  # every config refused before anything loads
    with Usage() as loading:
        lm = load_model(cfg.model)
    for q in recipes:
        if q.engine.library:
            engine_cache.check_model(q.name, lm.spec.name, lm.spec.layer_types)
    if any(q.prefix for q in recipes) and lm.spec.bos_token_id is None:
        raise UserError(f"quant.prefix=true: the tokenizer of model {lm.spec.name} has no BOS token "
                        f"(bos_token_id is None), and the prefix ends in BOS")
    with Usage() as windowing:
        windows = build_windows(cfg.data, lm.tokenizer)
    runner = Runner(cfg.cache_dir, model_identity(lm), windows.data_id, log=log, show_progress=show_progress)
    runner.add_step("load model", loading, runner.model_id)
    runner.add_step("windows", windowing, sha256_json([runner.model_id, windows.data_id]))
    ctx = Context(lm.model, lm.spec, lm.tokenizer, windows.calib, windows.eval, windows.long)
    results: dict[str, StageResult] = runner.run(stage_graph(cfg, recipes), ctx)
    calib_wall = sum(r.wall_s for r in runner.records if r.name.split("-")[0] in CALIBRATION_STAGES)
    summary = {
        "recipe": cfg.quant.name,
        "model": lm.spec.to_dict(),
        "data": {"description": windows.description, "calib_sha256": windows.calib_sha256,
                 "eval_sha256": windows.eval_sha256, "n_samples": cfg.data.n_samples, "seq_len": cfg.data.seq_len,
                 "seed": cfg.data.seed, "eval_n_samples": cfg.data.eval_n_samples,
                 "eval_seq_len": cfg.data.eval_seq_len},
        "stages": [r.__dict__ for r in runner.records],
        "stage_meta": {name: res.meta for name, res in results.items()
                       if name != "evaluate" and name.split("-")[0] in CALIBRATION_STAGES},
        "calib_wall_s": calib_wall,
        "wall_s": time.perf_counter() - start,
        "peak_rss_mb": peak_rss_mb(),
    }
    if "evaluate" in results:
        summary["evaluation"] = results["evaluate"].meta
    if "evaluate-long" in results:  # beside summary["data"], which the manifest's provenance records as it is
        summary["evaluation_long"] = {**results["evaluate-long"].meta, "sha256": windows.long_sha256}
    if cfg.llamacpp.types and "evaluate" in results:  # the engine itself, on the same evaluation windows
        from pipeline import llamacpp
        summary["evaluation_llamacpp"] = {**llamacpp.evaluate(cfg.llamacpp, cfg.model, windows.eval, log=log),
                                          "sha256": windows.eval_sha256}
    run_dir.mkdir(parents=True, exist_ok=True)
    target = layer_policy.target_policy(target_of(cfg, recipes), lm.spec.n_layers, results)
    if "evaluate-mixed" in results:  # the artifact is the mixed per-layer policy
        mixed = results["evaluate-mixed"].meta
        summary["mixed"] = {"layer_policy": mixed["layer_policy"], "recipe": mixed["recipe"]}
        summary["evaluation"]["recipes"][target.name] = mixed["recipe"]
    if "evaluate" in results:
        summary["sanity"] = {"warnings": sanity.run_warnings(summary)}  # the model's own: does it predict at all?
        summary["drift"] = analysis.drift(cfg, results, target)
    if cfg.export.enabled:
        provenance = {"data": summary["data"],
                      "stages": {r.name: {"cache_key": r.key, "config_sha256": r.config_sha256} for r in runner.records}}
        prefix = None
        if cfg.quant.prefix and "prefix_tokens" in results:  # the full-precision prefix K/V ship with the artifact
            pt = results["prefix_tokens"].tensors
            prefix = {"token_ids": pt["ids"].tolist(), "k": pt["k_post"], "v": pt["v"]}
        # the steps' times are recorded under what they depend on: the run's stages (their keys) and their config
        inputs = sha256_json({"stages": runner.keys, "export": cfg.export, "check": cfg.check})
        with runner.step("export", inputs):
            summary.update(export(run_dir, target, lm.spec, provenance,
                                  summary.get("evaluation", {}).get("recipes", {}), prefix=prefix,
                                  overwrite=cfg.export.overwrite))
        if cfg.check.enabled:  # kernel vs oracle on the exported artifact; the manifest records the outcome
            from pipeline.check import run_check
            summary["runtime_check"] = run_check(summary["artifact_dir"], lm, cfg.check, log=log,
                                                 timer=lambda name: runner.step(name, inputs))
        if "gate" in summary.get("drift", {}):
            faults.point("export.before_update_manifest")
            update_manifest(summary["artifact_dir"], gate=summary["drift"]["gate"])
        served_ok = (summary.get("runtime_check", {}).get("status", "passed") == "passed"
                     and summary.get("drift", {}).get("gate", {}).get("passed", True))
        # the artifact is final: what the run records is the shipped manifest's hash (the check and the gate
        # wrote their records into it above; nothing writes it after this)
        summary["manifest"]["sha256"] = sha256_file(Path(summary["artifact_dir"]) / "manifest.json")
        if cfg.export.vllm and servable(target) and served_ok:  # a folder ready to serve: only what passed
            with runner.step("vllm folder", inputs):
                checkpoint = write_vllm_checkpoint(run_dir / CHECKPOINT_DIR, Path(summary["artifact_dir"]), lm,
                                                   source_directory(cfg.model), overwrite=cfg.export.overwrite)
            summary["vllm_checkpoint_dir"] = str(checkpoint.resolve())
    if "evaluate" in results:
        with runner.step("report", sha256_json({"stages": runner.keys})):
            examples = analysis.changed_examples(lm, windows.eval[0], target)
            summary["report"] = str(analysis.write_report(run_dir, summary, target, lm.spec, examples))
    summary["stages"] = [dict(r.__dict__) for r in runner.records]  # with the stages run after calibration
    summary["steps"] = [dict(r.__dict__) for r in runner.steps]    # the timed parts that are not cached stages
    summary["wall_s"] = time.perf_counter() - start
    busy = runner.busy_note()
    if busy:
        summary["busy"] = busy
    faults.point("summary.before_write")
    atomic_write_json(run_dir / "summary.json", summary)
    log(runner.table())
    if busy:
        log(busy)
    for warning in summary.get("sanity", {}).get("warnings", []):  # above the figures it puts in doubt
        log(f"warning: {warning}")
    if "evaluation" in summary:
        log(evaluate.table(summary["evaluation"]["recipes"], n_windows=summary["evaluation"]["windows"]))
    if "evaluation_long" in summary:
        ev = summary["evaluation_long"]
        log(f"long context: {ev['windows']} windows x {ev['seq_len']} tokens")
        log(evaluate.table(ev["recipes"], n_windows=ev["windows"]))
    if "evaluation_llamacpp" in summary:
        from pipeline.llamacpp import table as llamacpp_table
        ev = summary["evaluation_llamacpp"]
        log(f"llama.cpp {ev['llama_cpp_version']} ({ev['gguf']}), ratios to its own f16 cache:")
        log(llamacpp_table(ev))
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
    if summary.get("artifact_dir"):
        log(next_steps(summary, target, run_dir, cfg))
    return {"summary": summary, "results": results, "runner": runner, "model": lm, "windows": windows}


def next_steps(summary: dict, policy, run_dir: Path, cfg: RunConfig) -> str:
    """What to do with the run's artifact, printed at the end of a run: check it again, serve it in Python, serve it
    with vLLM (the folder the run wrote, the packed folder export-vllm writes, or why vLLM cannot and the nearest
    recipes it can), pick a vLLM cache dtype, browse the run in MLflow. Paths are the run's own."""
    import shlex

    from exporters.compressed_tensors import CheckpointError, checkpoint_kind
    from pipeline.export import nearest_vllm_recipes
    from pipeline.model import model_arguments

    artifact = summary["artifact_dir"]
    model_args = shlex.join(model_arguments(summary["model"].get("source"), cfg.model.name))
    lines = ["next steps:",
             f"  check it again (never modifies it):  kvcalib check {artifact}",
             f"  serve it in Python:                  from serving import load_artifact, generate   "
             f"(README: quantize your model and serve it)"]
    if summary.get("vllm_checkpoint_dir"):
        lines.append(f"  serve it with vLLM:                  vllm serve {summary['vllm_checkpoint_dir']} "
                     f"--kv-cache-dtype fp8")
    else:
        try:
            kind = checkpoint_kind(policy)
        except CheckpointError:
            kind = None
        if kind == "packed":
            out = Path(run_dir).resolve() / "vllm-packed"
            lines.append(f"  serve it with vLLM (kvcalib plugin): kvcalib export-vllm {artifact} {out}   "
                         f"then: vllm serve {out} --kv-cache-dtype auto")
        elif kind == "fp8":
            out = Path(run_dir).resolve() / CHECKPOINT_DIR
            lines.append(f"  serve it with vLLM:                  kvcalib export-vllm {artifact} {out}   "
                         f"then: vllm serve {out} --kv-cache-dtype fp8")
        else:
            near = nearest_vllm_recipes(policy.name)
            if near:
                lines.append(f"  vLLM cannot serve {policy.name} (fp16 windows / smoothing / prefix / rotation "
                             f"need per-request state: `kvcalib export-vllm` says which); the nearest recipes it "
                             f"serves: {', '.join(n for n, _ in near)}:  kvcalib run {model_args} quant={near[0][0]}")
    lines.append(f"  which vLLM --kv-cache-dtype to use:  kvcalib recommend {Path(run_dir).resolve()}")
    if cfg.tracking.enabled:
        lines.append(f"  browse the run in MLflow:            mlflow ui --backend-store-uri {cfg.tracking.uri}")
    return "\n".join(lines)
