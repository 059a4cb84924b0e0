"""The runtime equivalence check of an exported artifact: the Triton kernel reading its cache -- and on a machine
without a GPU also the fused CPU kernel that serves there (serving/cpu_attention.py) -- computes the oracle's
attention. `python -m pipeline check DIR` (main) and, after export, `python -m pipeline run` (run_check).

For each context length T and batch size B of CheckConfig: B consecutive windows of evaluation text (the
embedded source, so it runs on every machine) are compared through runtime_check.check.check_case, which fills
the artifact's cache (prefill T tokens, then one decode step) and attends over it in every layer with the kernel
and the oracle. The result -- status, errors, tolerance and its reason, device, Triton version -- is the
`runtime_check` record: a run writes it into the manifest of the artifact it is writing (before the run records the
manifest's sha256); `check` on an existing artifact never modifies it and writes the record beside it
(ARTIFACT.check.json, or --out). Without a GPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1). This
module verifies the artifact, loads the model it names (model.source, overridable), reads the text and the
options; the comparison itself is runtime_check/check.py's.

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
from pipeline.errors import (EXIT_CHECK_FAILED, EXIT_OK, EXIT_USER, RuntimeCheckError, UserError, refusal_text,
                             user_errors)

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


def model_config_for(manifest: dict, overrides: list[str] | None = None):
    """The model the artifact names: its recorded model.source (pipeline.model.model_source: the folder, hub id or
    embedded package and the run's model settings), with `model.<field>=VALUE` overrides on top (a moved folder:
    model.path=...; another device: model.device=...). An artifact written before model.source existed names its
    conf/model/<name>.yaml."""
    from pipeline.model import config_from_source

    source = manifest["model"].get("source") or {"config": manifest["model"]["name"]}
    return config_from_source(source, overrides)


def refuse_malformed_model_config(model_cfg) -> None:
    """A model folder's config.json (model.source local, or hub with model.path a folder) read as untrusted input
    before transformers reads it, which would fail on it with an OSError, ValueError or RecursionError (EXIT_INTERNAL):
    refused (EXIT_USER, naming model.path and the field) unless it is a regular file (a link is followed: a hub
    snapshot's files are links) of at most exporters.artifact.MAX_JSON_BYTES holding a JSON object nested at most
    MAX_DEPTH deep with a supported `model_type`. Absent: left to load_model, which names what is missing."""
    import stat

    from exporters.artifact import MAX_JSON_BYTES, file_kind, parse_json_object, read_regular
    from pipeline.model import SUPPORTED_MODEL_TYPES

    if model_cfg.source not in ("local", "hub") or not model_cfg.path:
        return
    directory = Path(model_cfg.path).expanduser()
    if not directory.is_dir():
        return
    where, path = f"model.path={str(directory)!r}", directory / "config.json"
    try:
        mode = os.stat(path).st_mode
        if not stat.S_ISREG(mode):  # before opening: a FIFO would block, a device never ends
            raise UserError(f"{where}: config.json is {file_kind(mode)}; allowed a regular file")
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        return
    except OSError as exc:
        raise UserError(f"{where}: config.json cannot be read ({exc.strerror})") from None
    try:
        raw = read_regular(fd, MAX_JSON_BYTES, "config.json", where, "a model's config.json is a few KB")
    finally:
        os.close(fd)
    config = parse_json_object(raw, f"{where} config.json", UserError)
    if config.get("model_type") not in SUPPORTED_MODEL_TYPES:
        got = config.get("model_type", "(absent)")
        raise UserError(f"{where} config.json model_type: allowed one of {list(SUPPORTED_MODEL_TYPES)}, got "
                        f"{repr(got)[:120]}")


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
              kernel: Callable | None = None, write: bool = True, log: Callable[[str], None] = print,
              model_overrides: list[str] | None = None) -> dict:
    """Kernel vs oracle on real K/V of the model the artifact names -> the runtime_check record. write=True (the
    run, on the artifact it is still writing) also records it in the manifest; `python -m pipeline check` passes
    write=False and never changes an artifact (main writes the record beside it). The artifact is read and verified
    whole (digest, schema, every checksum) before any model loads; then the model (model_bundle: a
    pipeline.model.LoadedModel, else the one the manifest's model.source names with model_overrides on top) is
    bound to it (weights, shapes, RoPE, tokenizer). kernel: the attention under test (DecodeInputs -> [B, H_q, D]);
    tests pass a faulty one."""
    from exporters.compressed_tensors import is_checkpoint
    from exporters.manifest import check_model
    from exporters.native import load_artifact, update_manifest

    native = ensure_backend()  # Triton's interpreter chosen before anything imports triton
    cfg = cfg or CheckConfig()
    contexts = list(cfg.gpu_contexts if native else cfg.contexts)
    batches = list(cfg.batches)
    validate_check_options(contexts, batches, None, cfg.canary_tokens)  # before anything is loaded for nothing
    if is_checkpoint(artifact_dir):  # a vLLM checkpoint's sealed copy (kvcalib/): checked, never rewritten
        write = False
    artifact = load_artifact(artifact_dir)  # the whole folder verified, before the model
    if model_bundle is None:
        from pipeline.model import load_model
        model_cfg = model_config_for(artifact.manifest, model_overrides)
        refuse_malformed_model_config(model_cfg)
        model_bundle = load_model(model_cfg)
    check_model(artifact.manifest, model_bundle.spec)

    import triton

    from runtime_check.check import RTOL, KernelFailed, artifact_prefix, check_case, tolerance

    # the kernels under test: a given one (tests pass a faulty one), else the Triton kernel -- natively on a GPU,
    # interpreted on a CPU -- and, on a machine without a GPU, the fused CPU kernel that serves there
    # (serving/cpu_attention.py) when it is built
    kernels = {"given": kernel} if kernel is not None else {"triton": triton_kernel(native)}
    if kernel is None and not native:
        from serving import cpu_attention

        if cpu_attention.available():
            kernels["cpu"] = cpu_attention.decode_attention
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
    canary = None
    if cfg.canary_tokens and error is None:
        canary = quality_canary(artifact, model_bundle, cfg.canary_tokens, log)
    passed = error is None and bool(cases) and all(c["ok"] for c in cases) and (canary is None or canary["ok"])
    result = {
        "status": "passed" if passed else "failed",
        "max_abs_err": max((c["max_abs_err"] for c in cases), default=None),
        "max_rel_err": max((c["max_rel_err"] for c in cases), default=None),
        "tolerance": tol, "reason": reason, "device": device_name(), "triton": triton.__version__,
        "interpreter": not native, "kernels": list(kernels), "contexts": contexts, "batches": batches, "cases": cases,
        **{k: round(v, 3) for k, v in timing.items()},
        "data": "embedded:pydoc_data.topics (evaluation half)",
    }
    if canary is not None:
        result["canary"] = canary
    if error:
        result["error"] = error
    if write:
        update_manifest(artifact_dir, runtime_check=result)
    if passed:
        log(f"runtime check passed: max_abs_err {result['max_abs_err']:.3e}, max_rel_err "
            f"{result['max_rel_err']:.3e} <= rtol {RTOL:g} (Triton {triton.__version__}, {result['device']})")
    else:
        why = error or ("the quality canary " + canary["reason"] if canary is not None and not canary["ok"]
                        else "kernel and oracle disagree beyond the tolerance")
        log(f"runtime check FAILED: {why}")
    return result


def quality_canary(artifact, model_bundle, tokens: int, log: Callable[[str], None]) -> dict | None:
    """runtime_check/canary.py on the artifact's policy and the model: measured, then judged against the
    calibration-free limit and the canary the artifact's run recorded (manifest runtime_check.canary), if any."""
    from runtime_check import canary
    from runtime_check.check import artifact_prefix

    recorded = (artifact.manifest.get("runtime_check") or {}).get("canary")
    fit = canary.lengths(artifact.policy, model_bundle.spec.max_positions, tokens)
    if fit is None:
        log(f"  quality canary: not run -- the model's {model_bundle.spec.max_positions} positions cannot hold the "
            f"artifact's sink, residual and stored rows and 16 scored tokens")
        return None
    warmup, tokens = fit
    ids = eval_ids(model_bundle.tokenizer, 1, warmup + tokens)
    measured = canary.measure(model_bundle.model, artifact.policy, ids, warmup, artifact_prefix(artifact))
    result = canary.judge(measured, recorded)
    log(f"  quality canary ({result['tokens']} tokens decoded after {result['warmup']}): KL "
        f"{result['kl']:.4g} nats, top-1 agreement {result['agreement']:.3f}; calibration-free baseline KL "
        f"{result['baseline_kl']:.4g} -> {result['reason']}")
    return result


def result_path(artifact_dir: str | Path) -> Path:
    """Where `check` writes its record by default: beside the artifact folder, never inside it
    (outputs/<date>/<time>/artifact -> outputs/<date>/<time>/artifact.check.json)."""
    directory = Path(artifact_dir).resolve()
    return directory.parent / f"{directory.name}.check.json"


USAGE = """usage: {prog} check ARTIFACT [model.<field>=VALUE ...] [contexts=[64,200]] [batches=[1,2]]
                     [gpu_contexts=[...]] [--out FILE]

Runs the runtime equivalence check on an exported artifact (or a vLLM checkpoint folder written by export-vllm):
the decode kernels (Triton; on a CPU also the fused C kernel) reading the artifact's stored cache against the
oracle, on real K/V of the model the artifact was calibrated on. The artifact is verified whole (digest, schema,
checksums) before the model loads, and is never modified.

  ARTIFACT                 the artifact folder (outputs/<date>/<time>/artifact) or a vLLM checkpoint folder
  model.<field>=VALUE      override where the model comes from; by default the model recorded in the
                           manifest (model.source): e.g. model.path=/new/place/of/the/folder, model.device=cuda
  contexts, batches        the context lengths and batch sizes checked on a CPU (default [64,200] x [1,2])
  gpu_contexts             the context lengths checked on a GPU (default [64,200,1024,4096])
  canary_tokens            tokens of the quality canary (default 128; 0: off): model-sampled text served
                           through the artifact's cache, KL vs full precision, judged against a calibration-free
                           baseline and the canary the artifact's run recorded (docs/manifest.md)
  --out FILE               where the record (JSON) goes; default ARTIFACT.check.json beside the folder

exit codes: 0 passed, 1 failed, 2 refused (artifact, model or option)
example: {prog} check outputs/2026-12-05/01-16-29/artifact
"""


def main(args: list[str]) -> int:
    """`python -m pipeline check DIR [model.<field>=...] [contexts=[64,200]] [batches=[1,2]] [gpu_contexts=[...]]
    [--out FILE]`: EXIT_OK when the check passes, EXIT_CHECK_FAILED when it fails, EXIT_USER when the artifact,
    the model or the arguments are refused (pipeline.errors.user_errors()); anything else propagates
    (pipeline/cli.py: EXIT_INTERNAL). The artifact is never modified: the record goes to --out or
    ARTIFACT.check.json beside the folder."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from exporters.files import atomic_write_json

    rest, out = list(args[1:]), None
    if "--out" in rest:
        i = rest.index("--out")
        if i + 1 >= len(rest):
            print("error: --out needs a FILE", file=sys.stderr)
            return EXIT_USER
        out = Path(rest[i + 1])
        del rest[i : i + 2]
    directory = args[0]
    model_overrides = [a for a in rest if a.startswith("model.")]
    overrides = [a.removeprefix("check.") for a in rest if not a.startswith("model.")]
    try:
        if not Path(directory).is_dir():
            raise UserError(f"ARTIFACT: no such folder {directory!r} (an artifact folder holds manifest.json and "
                            f"tensors.safetensors: outputs/<date>/<time>/artifact)")
        cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(CheckConfig), OmegaConf.from_dotlist(overrides)))
        result = run_check(directory, cfg=cfg, write=False, model_overrides=model_overrides)
    except OmegaConfBaseException as exc:
        print(f"error: invalid check option: {exc}", file=sys.stderr)
        return EXIT_USER
    except user_errors() as exc:  # the strict loader refused the artifact, or an option / the model was refused
        print(f"error: {directory}: {type(exc).__name__}: {refusal_text(exc)}", file=sys.stderr)
        return EXIT_USER
    target = out or result_path(directory)
    atomic_write_json(target, result)
    print(f"check record: {target}")
    return EXIT_OK if result["status"] == "passed" else EXIT_CHECK_FAILED


__all__ = ["run_check", "main", "result_path", "USAGE", "triton_kernel", "model_config_for",
           "refuse_malformed_model_config", "eval_ids", "ensure_backend", "device_name",
           "RuntimeCheckError"]
