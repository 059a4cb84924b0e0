"""The runtime equivalence check of an exported artifact: the Triton kernel reading its cache -- and on a machine
without a GPU also the fused CPU kernel that serves there (serving/cpu_attention.py) -- computes the oracle's
attention. `python -m pipeline check DIR` (main) and, after export, `python -m pipeline run` (run_check).

For each context length T and batch size B of CheckConfig: B consecutive windows of evaluation text (the
embedded source, so it runs on every machine) are compared through runtime_check.check.check_case, which fills
the artifact's cache (prefill T tokens, then one decode step) and attends over it in every layer with the kernel
and the oracle. The result -- status, errors, tolerance and its reason, device, Triton version -- is written
into the manifest's `runtime_check` field. Without a GPU the kernels run in Triton's interpreter
(TRITON_INTERPRET=1). This module loads the model the artifact names, reads the text and the options, and
writes the manifest; the comparison itself is runtime_check/check.py's.

The options, CheckConfig, live in pipeline/check_config.py (pipeline/config.py composes them without importing
this module). This module imports only the standard library and pipeline's light modules at its top; torch,
Triton, the model and the comparison are imported when a check runs (ensure_backend chooses Triton's interpreter
before anything imports triton).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from pipeline.check_config import CheckConfig, validate_check_options
from pipeline.errors import EXIT_CHECK_FAILED, EXIT_OK, EXIT_USER, RuntimeCheckError, UserError, user_errors

if TYPE_CHECKING:
    import torch


def ensure_backend() -> bool:
    """True when the kernels run natively on a GPU; else select Triton's interpreter before triton is imported."""
    import torch

    if torch.cuda.is_available():
        return True
    os.environ["TRITON_INTERPRET"] = "1"
    return False


def device_name() -> str:
    import torch

    if torch.cuda.is_available():
        return f"cuda:{torch.cuda.get_device_name()}"
    return "cpu (TRITON_INTERPRET=1)"


def triton_kernel(native: bool) -> Callable:
    """The attention under test: DecodeInputs -> [B, H_q, D] by the Triton kernel, launched on the device of each
    layer's inputs -- under a device_map the layer's own GPU, never the first GPU for every layer. Inputs on the
    CPU of a GPU machine (a model on the CPU) go to the current GPU, copied as stored (triton_attention.prepare);
    without a GPU the kernel runs on the CPU in Triton's interpreter, in few large tiles (its cost is per tile)."""
    import torch

    from serving import triton_attention

    block_t = 32 if native else 256

    def kernel(inp):
        device = inp.q.device if inp.q.device.type == "cuda" or not native else torch.device("cuda")
        return triton_attention.decode_attention(inp, block_t=block_t, device=device)

    return kernel


def model_config_for(manifest: dict):
    """The model the artifact names: conf/model/<name>.yaml (tiny, smollm2, llama3, ...)."""
    from pipeline.config import load_model_config, model_names

    name = manifest["model"]["name"]
    if name not in model_names():
        raise UserError(f"artifact model.name={name!r} has no conf/model/{name}.yaml; known models: {model_names()}")
    return load_model_config(name)


def eval_ids(tokenizer, n_windows: int, length: int) -> torch.Tensor:
    """[n_windows, length] consecutive windows of the embedded evaluation text."""
    from pipeline.config import DataConfig
    from pipeline.data import consecutive_windows, load_texts, tokenize

    _, text, _ = load_texts(DataConfig(source="embedded"))
    need = n_windows * length
    chars = 8 * need + 1024  # tokenize only what the windows need (the text is ~1e6 characters)
    ids = tokenize(tokenizer, text[:chars])
    if ids.numel() < need:
        ids = tokenize(tokenizer, text)
    return consecutive_windows(ids, n_windows, length, what="runtime-check")


def run_check(artifact_dir: str | Path, model_bundle=None, cfg: CheckConfig | None = None,
              kernel: Callable | None = None, write: bool = True, log: Callable[[str], None] = print) -> dict:
    """Kernel vs oracle on real K/V of the model the artifact names -> the runtime_check record (also written
    into the manifest unless write=False). model_bundle: a pipeline.model.LoadedModel (loaded when None).
    kernel: the attention under test (DecodeInputs -> [B, H_q, D]); tests pass a faulty one."""
    native = ensure_backend()
    import triton

    from exporters.artifact import read_manifest
    from exporters.compressed_tensors import ARTIFACT_DIR, is_checkpoint
    from exporters.native import load_artifact, update_manifest
    from runtime_check.check import RTOL, KernelFailed, artifact_prefix, check_case, tolerance

    # the kernels under test: a given one (tests pass a faulty one), else the Triton kernel -- natively on a GPU,
    # interpreted on a CPU -- and, on a machine without a GPU, the fused CPU kernel that serves there
    # (serving/cpu_attention.py) when it is built
    kernels = {"given": kernel} if kernel is not None else {"triton": triton_kernel(native)}
    if kernel is None and not native:
        from serving import cpu_attention

        if cpu_attention.available():
            kernels["cpu"] = cpu_attention.decode_attention
    cfg = cfg or CheckConfig()
    contexts = list(cfg.gpu_contexts if native else cfg.contexts)
    batches = list(cfg.batches)
    validate_check_options(contexts, batches, None)  # before a model is loaded for nothing
    if is_checkpoint(artifact_dir):  # a vLLM checkpoint's sealed copy (kvcalib/): checked, never rewritten
        manifest, write = read_manifest(Path(artifact_dir) / ARTIFACT_DIR), False
    else:
        manifest = read_manifest(artifact_dir)
    if model_bundle is None:
        from pipeline.model import load_model
        model_bundle = load_model(model_config_for(manifest))
    artifact = load_artifact(artifact_dir, model_bundle.spec)
    prefix = artifact_prefix(artifact)
    validate_check_options(contexts, batches,
                           model_bundle.spec.max_positions - (0 if prefix is None else prefix["ids"].numel()))
    windows = eval_ids(model_bundle.tokenizer, max(batches), max(contexts) + 1)
    tol, reason = tolerance(artifact.manifest)
    log(f"runtime check: {artifact.manifest['recipe']} on {artifact.manifest['model']['name']}, "
        f"contexts {contexts} x batches {batches}, {model_bundle.spec.n_layers} layers, {device_name()}")
    cases, timing, error = [], {"kernel_s": 0.0, "oracle_s": 0.0}, None
    for t in contexts:
        for b in batches:
            by_kernel = {}
            try:
                for name, fn in kernels.items():
                    by_kernel[name] = check_case(model_bundle, artifact.policy, windows[:b, : t + 1], prefix, fn,
                                                 timing)
            except KernelFailed as exc:
                error = f"context {t}, batch {b}, {name} kernel: {exc}"
                break
            worst = max(by_kernel.values(), key=lambda c: (not c["ok"], c["max_rel_err"]))
            case = {k: worst[k] for k in ("max_abs_err", "max_rel_err", "worst_layer")}
            case["ok"] = all(c["ok"] for c in by_kernel.values())
            cases.append({"context": t, "batch": b, **case, "kernels": by_kernel})
            for name, c in by_kernel.items():
                log(f"  context {t:>6} batch {b} {name:>6}: max_abs_err {c['max_abs_err']:.3e} max_rel_err "
                    f"{c['max_rel_err']:.3e} (layer {c['worst_layer']}) {'ok' if c['ok'] else 'FAILED'}")
        if error:
            break
    passed = error is None and bool(cases) and all(c["ok"] for c in cases)
    result = {
        "status": "passed" if passed else "failed",
        "max_abs_err": max((c["max_abs_err"] for c in cases), default=None),
        "max_rel_err": max((c["max_rel_err"] for c in cases), default=None),
        "tolerance": tol, "reason": reason, "device": device_name(), "triton": triton.__version__,
        "interpreter": not native, "kernels": list(kernels), "contexts": contexts, "batches": batches, "cases": cases,
        **{k: round(v, 3) for k, v in timing.items()},
        "data": "embedded:pydoc_data.topics (evaluation half)",
    }
    if error:
        result["error"] = error
    if write:
        update_manifest(artifact_dir, runtime_check=result)
    if passed:
        log(f"runtime check passed: max_abs_err {result['max_abs_err']:.3e}, max_rel_err "
            f"{result['max_rel_err']:.3e} <= rtol {RTOL:g} (Triton {triton.__version__}, {result['device']})")
    else:
        log(f"runtime check FAILED: {error or 'kernel and oracle disagree beyond the tolerance'}")
    return result


def main(args: list[str]) -> int:
    """`python -m pipeline check DIR [contexts=[64,200]] [batches=[1,2]] [gpu_contexts=[...]]`: EXIT_OK when the
    check passes, EXIT_CHECK_FAILED when it fails, EXIT_USER when the artifact or the arguments are refused
    (pipeline.errors.user_errors()); anything else propagates (pipeline/cli.py: EXIT_INTERNAL)."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    directory, overrides = args[0], [a.removeprefix("check.") for a in args[1:]]
    try:
        cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(CheckConfig), OmegaConf.from_dotlist(overrides)))
        result = run_check(directory, cfg=cfg)
    except OmegaConfBaseException as exc:
        print(f"error: invalid check option: {exc}", file=sys.stderr)
        return EXIT_USER
    except user_errors() as exc:  # the strict loader refused the artifact, or an option / the model was refused
        print(f"error: {directory}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_USER
    return EXIT_OK if result["status"] == "passed" else EXIT_CHECK_FAILED


__all__ = ["run_check", "main", "triton_kernel", "model_config_for", "eval_ids", "ensure_backend", "device_name",
           "RuntimeCheckError"]
