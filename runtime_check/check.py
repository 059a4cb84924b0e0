"""The runtime equivalence gate: the Triton kernel reading an exported cache computes the oracle's attention.

For each context length T and batch size B: B consecutive windows of evaluation text (the embedded source, so
it runs on every machine) fill an ArtifactCache under the artifact's policy (prefill T tokens, then one decode
step), the decode step's post-RoPE queries are captured in every layer, and for every layer the kernel
(runtime_check/triton_attention.py) and the oracle (runtime_check/reference.py) attend over the same stored
cache. The result -- status, errors, tolerance and its reason, device, Triton version -- is written into the
manifest's `runtime_check` field. Without a GPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1).
"""
from __future__ import annotations

import os
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable

import torch

from pipeline.config import CheckConfig

ATOL = 1e-6
RTOL = 2e-4


class RuntimeCheckError(ValueError):
    """The kernel disagrees with the oracle beyond the tolerance, or could not run; the manifest records it.
    A ValueError so that `python -m pipeline run` reports it as one line and exits non-zero."""

    def __init__(self, artifact_dir, result: dict):
        cause = result.get("error") or (f"max_rel_err {result['max_rel_err']:.3e} beyond rtol "
                                        f"{result['tolerance']['rtol']:g} (max_abs_err {result['max_abs_err']:.3e})")
        super().__init__(f"runtime check failed for {artifact_dir}: {cause}; see runtime_check in its manifest.json")
        self.result = result


def ensure_backend() -> bool:
    """True when the kernels run natively on a GPU; else select Triton's interpreter before triton is imported."""
    if torch.cuda.is_available():
        return True
    os.environ["TRITON_INTERPRET"] = "1"
    return False


def tolerance(manifest: dict) -> tuple[dict, str]:
    """The kernel and the oracle read the same bytes: codes, fp16 scales / zero-points, fp16 sparse outliers,
    fp8 bytes, fp16 sink and residual rows, float32 codebooks and static ranges. Each decodes them to the same
    float32 values up to one rounding (fused multiply-add); what remains is float32 rounding of order 1e-7..1e-6
    relative. So the bound is relative to the output scale and far below what any decoding mistake causes:
    a wrong level, position or axis moves the output by 1e-2..1 of its scale."""
    keys = [layer["key"] for layer in manifest["layers"]]
    terms = ["float32 accumulation order (D-term dot products; online base-2 softmax over tiles and splits vs "
             "torch.softmax)"]
    if manifest["cache"]["key_rope"] == "pre" and any(k["format"] != "fp16" for k in keys):
        terms.append("in-kernel cos/sin of position * inv_freq (range-reduced) vs the model's rotary module")
    if manifest["cache"]["smoothing"]:
        terms.append("lambda folded into q instead of multiplied into decoded keys")
    formats = sorted({layer[kind]["format"] for layer in manifest["layers"] for kind in ("key", "value")})
    reason = (f"formats {'/'.join(formats)}: kernel and oracle decode identical stored bytes (packed codes, fp16 "
              f"scales, zero-points and outliers, fp8 bytes, fp16 sink and residual rows) to identical float32 "
              f"values; they differ only by float32 rounding from " + "; ".join(terms) + ", each of order 1e-7.."
              f"1e-6 of the output scale (<= 2e-6 observed on SmolLM2-135M and the tiny model). rtol={RTOL:g} of "
              f"max|oracle| per layer leaves a ~100x margin over that and sits >100x below the error of a wrong "
              f"codebook level, RoPE position or cache axis (>= 3e-2 even on the tiny random model); "
              f"atol={ATOL:g} only guards all-zero outputs.")
    return {"atol": ATOL, "rtol": RTOL,
            "criterion": "per case and layer: max|kernel - oracle| <= atol + rtol * max|oracle|"}, reason


def model_config_for(manifest: dict):
    """The model the artifact names: conf/model/<name>.yaml (tiny, smollm2, llama3, ...)."""
    from omegaconf import OmegaConf

    from pipeline.config import CONF_DIR, ModelConfig
    from pipeline.errors import UserError

    name = manifest["model"]["name"]
    path = CONF_DIR / "model" / f"{name}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in (CONF_DIR / "model").glob("*.yaml"))
        raise UserError(f"artifact model.name={name!r} has no conf/model/{name}.yaml; known models: {known}")
    obj = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), OmegaConf.load(path)))
    assert isinstance(obj, ModelConfig)
    return obj


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


def record(lm, policy, ids: torch.Tensor, prefix: dict | None = None) -> list:
    """Fill an ArtifactCache with ids [B, T + 1] (prefill T, decode one) -> DecodeInputs per layer for the
    decode step. prefix: {"ids": [P], "k", "v": [L, H, P, D]} rows served from the artifact at positions 0..P-1."""
    from runtime_check.cache import ArtifactCache
    from runtime_check.inputs import from_layer
    from stages.hooks import attention_override, eager_attention

    model = lm.model
    device = next(model.parameters()).device
    if prefix is not None:
        p = prefix["ids"].numel()
        ids = torch.cat([prefix["ids"].to(ids)[None].expand(ids.shape[0], p), ids], 1)
        policy = replace(policy, n_sink=max(policy.n_sink, p))  # the prefix rows are never quantized
    ids = ids.to(device)
    cache = ArtifactCache(policy, model)
    queries: dict[int, tuple[torch.Tensor, float]] = {}

    def capture(module, query, key, value, mask, scaling):
        queries[module.layer_idx] = (query[:, :, -1].detach().float().cpu(), float(scaling))
        return eager_attention(query, key, value, mask, scaling)

    with torch.no_grad():
        model(ids[:, :-1], cache=cache)
        if prefix is not None:  # serve the artifact's prefix rows, as a runtime would
            for i, layer in enumerate(cache.layers):
                k, v = (t[i].to(torch.float16)[None].expand(ids.shape[0], -1, -1, -1)
                        for t in (prefix["k"], prefix["v"]))
                p = k.shape[2]
                layer.sink = (torch.cat([k, layer.sink[0][:, :, p:]], 2), torch.cat([v, layer.sink[1][:, :, p:]], 2))
        with attention_override(model, capture):
            model(ids[:, -1:], cache=cache)
    rotary = model.model.rotary_emb
    return [from_layer(layer, queries[i][0], queries[i][1], rotary) for i, layer in enumerate(cache.layers)]


def compare(kernel_out: torch.Tensor, oracle_out: torch.Tensor) -> dict:
    diff = (kernel_out.detach().float().cpu() - oracle_out.float()).abs()
    scale = float(oracle_out.abs().max())
    finite = bool(torch.isfinite(kernel_out).all())
    max_abs = float(diff.max()) if finite else float("inf")
    return {"max_abs_err": max_abs, "max_rel_err": max_abs / max(scale, ATOL), "scale": scale,
            "ok": finite and max_abs <= ATOL + RTOL * scale}


class _KernelFailed(Exception):
    """The kernel raised: a failed check, recorded with its cause."""


def _check_case(lm, policy, ids: torch.Tensor, prefix: dict | None, kernel: Callable, timing: dict) -> dict:
    """Every layer of one (context, batch): kernel vs oracle -> the worst layer's errors."""
    from runtime_check import reference

    worst = None
    for i, inp in enumerate(record(lm, policy, ids, prefix)):
        start = time.perf_counter()
        try:
            out = kernel(inp)
        except Exception as exc:  # noqa: BLE001 -- any kernel failure is a check failure, never a crash
            raise _KernelFailed(f"layer {i}: {type(exc).__name__}: {exc}") from exc
        timing["kernel_s"] += time.perf_counter() - start
        start = time.perf_counter()
        ref = reference.decode_attention(inp)
        timing["oracle_s"] += time.perf_counter() - start
        res = compare(out, ref) | {"worst_layer": i}
        if worst is None or (not res["ok"], res["max_rel_err"]) > (not worst["ok"], worst["max_rel_err"]):
            worst = res
    return {k: worst[k] for k in ("max_abs_err", "max_rel_err", "worst_layer", "ok")}


def device_name() -> str:
    if torch.cuda.is_available():
        return f"cuda:{torch.cuda.get_device_name()}"
    return "cpu (TRITON_INTERPRET=1)"


def run_check(artifact_dir: str | Path, model_bundle=None, cfg: CheckConfig | None = None,
              kernel: Callable | None = None, write: bool = True, log: Callable[[str], None] = print) -> dict:
    """Kernel vs oracle on real K/V of the model the artifact names -> the runtime_check record (also written
    into the manifest unless write=False). model_bundle: a pipeline.model.LoadedModel (loaded when None).
    kernel: the attention under test (DecodeInputs -> [B, H_q, D]); tests pass a faulty one."""
    native = ensure_backend()
    import triton

    from exporters.native import load_artifact, read_manifest, update_manifest

    if kernel is None:
        from runtime_check.triton_attention import decode_attention
        block_t = 32 if native else 256  # the interpreter's cost is per tile op: few large tiles on the CPU

        def kernel(inp):
            return decode_attention(inp, block_t=block_t)

    cfg = cfg or CheckConfig()
    contexts = list(cfg.gpu_contexts if native else cfg.contexts)
    batches = list(cfg.batches)
    _validate(contexts, batches, None)  # before a model is loaded for nothing
    manifest = read_manifest(artifact_dir)
    if model_bundle is None:
        from pipeline.model import load_model
        model_bundle = load_model(model_config_for(manifest))
    artifact = load_artifact(artifact_dir, model_bundle.spec)
    prefix = None
    if artifact.manifest["cache"]["prefix"]:
        pj = artifact.manifest["cache"]["prefix"]
        prefix = {"ids": torch.tensor(pj["token_ids"], dtype=torch.long),
                  "k": artifact.tensors[pj["tensors"]["k"]], "v": artifact.tensors[pj["tensors"]["v"]]}
    _validate(contexts, batches, model_bundle.spec.max_positions - (0 if prefix is None else prefix["ids"].numel()))
    windows = eval_ids(model_bundle.tokenizer, max(batches), max(contexts) + 1)
    tol, reason = tolerance(artifact.manifest)
    log(f"runtime check: {artifact.manifest['recipe']} on {artifact.manifest['model']['name']}, "
        f"contexts {contexts} x batches {batches}, {model_bundle.spec.n_layers} layers, {device_name()}")
    cases, timing, error = [], {"kernel_s": 0.0, "oracle_s": 0.0}, None
    for t in contexts:
        for b in batches:
            try:
                case = _check_case(model_bundle, artifact.policy, windows[:b, : t + 1], prefix, kernel, timing)
            except _KernelFailed as exc:
                error = f"context {t}, batch {b}: {exc}"
                break
            cases.append({"context": t, "batch": b, **case})
            log(f"  context {t:>6} batch {b}: max_abs_err {case['max_abs_err']:.3e} max_rel_err "
                f"{case['max_rel_err']:.3e} (layer {case['worst_layer']}) {'ok' if case['ok'] else 'FAILED'}")
        if error:
            break
    passed = error is None and bool(cases) and all(c["ok"] for c in cases)
    result = {
        "status": "passed" if passed else "failed",
        "max_abs_err": max((c["max_abs_err"] for c in cases), default=None),
        "max_rel_err": max((c["max_rel_err"] for c in cases), default=None),
        "tolerance": tol, "reason": reason, "device": device_name(), "triton": triton.__version__,
        "interpreter": not native, "contexts": contexts, "batches": batches, "cases": cases,
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


def _validate(contexts: list[int], batches: list[int], max_context: int | None) -> None:
    """max_context: the model's positions less the prefix (None: not known yet, check the lower bounds only)."""
    from pipeline.errors import UserError

    if not contexts or not batches:
        raise UserError(f"check.contexts and check.batches must be non-empty, got {contexts} and {batches}")
    for t in contexts:
        if t < 1 or (max_context is not None and t >= max_context):
            upper = "" if max_context is None else f", {max_context - 1}"
            raise UserError(f"check.contexts: each context must be in [1{upper}] (at most the model's positions less "
                            f"the prefix and the decoded token), got {t}")
    for b in batches:
        if b < 1:
            raise UserError(f"check.batches: each batch size must be >= 1, got {b}")


def main(args: list[str]) -> int:
    """`python -m pipeline check DIR [contexts=[64,200]] [batches=[1,2]] [gpu_contexts=[...]]`: exit 0 when the
    check passes, 1 when it fails, 2 when the artifact or the arguments are refused."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from exporters.manifest import ManifestError
    from pipeline.errors import UserError

    directory, overrides = args[0], [a.removeprefix("check.") for a in args[1:]]
    try:
        cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(CheckConfig), OmegaConf.from_dotlist(overrides)))
        result = run_check(directory, cfg=cfg)
    except OmegaConfBaseException as exc:
        print(f"error: invalid check option: {exc}", file=sys.stderr)
        return 2
    except (ManifestError, UserError) as exc:
        print(f"error: {directory}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    return 0 if result["status"] == "passed" else 1


__all__ = ["run_check", "main", "tolerance", "record", "compare", "RuntimeCheckError"]
