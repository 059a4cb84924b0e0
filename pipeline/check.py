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
from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING, Callable, ContextManager

from pipeline.check_config import CheckConfig, validate_check_options
from pipeline.errors import (EXIT_CHECK_FAILED, EXIT_OK, EXIT_USER, MAX_REFUSAL_CHARS, RuntimeCheckError, UserError,
                             path_argument, shown, user_errors)

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


RANDOM_SOURCES = ("tiny", "shape")   # models built from settings, with random weights: never followed unasked


def model_config_for(manifest: dict, overrides: list[str] | None = None, model_name: str | None = None):
    """The model `check` judges on: the artifact's recorded model.source (pipeline.model.model_source: the folder,
    hub id or embedded package and the run's model settings) as a suggestion, with `model.<field>=VALUE` overrides on
    top (a moved folder: model.path=...; another device: model.device=...), or the user's conf/model/<model_name>.yaml
    (`model=NAME`). An artifact written before model.source existed names its conf/model/<name>.yaml.

    Followed without asking only to a model already on this machine: an embedded package, a local folder or GGUF
    file, a hub snapshot in the local cache (never a download). A random model (model.source tiny or shape) is built
    from settings the artifact wrote, so a stranger's artifact could name a random twin of any shape and tokenizer:
    only the user's own `model.source=...` or `model=NAME` on the command line loads one (and its size is bounded,
    pipeline.model.refuse_unbounded). Whichever model loads, its weights' sha256 is then compared with the artifact's
    record (run_check)."""
    from pipeline.model import _hub_snapshot, config_from_source

    overrides = list(overrides or [])
    if model_name is not None:
        source = {"config": model_name}
    else:
        source = manifest["model"].get("source") or {"config": manifest["model"]["name"]}
    cfg = config_from_source(source, overrides)
    asked = model_name is not None or any(o.partition("=")[0] == "model.source" for o in overrides)
    if cfg.source in RANDOM_SOURCES and not asked:
        raise UserError(f"model.source: the artifact names a random model ({cfg.source!r}, built from settings the "
                        f"artifact wrote), which check does not follow unasked; allowed without asking: a model on "
                        f"this machine (embedded, local, gguf, hub from the local cache). Pass the model to judge on: "
                        f"model.path=FOLDER (your model) or model=NAME; for a random test model say "
                        f"model.source={cfg.source} yourself")
    if cfg.source == "hub" and cfg.path and not Path(cfg.path).expanduser().is_dir() \
            and _hub_snapshot(cfg.path, local_only=True) is None:
        raise UserError(f"model.source=hub: {cfg.path!r} is not in this machine's Hugging Face cache, and check never "
                        f"downloads a model an artifact names; pass model.path=FOLDER (the model's folder)")
    return cfg


def judged_on(spec) -> str:
    """The model a verdict was reached on, as a user recognizes it: name, where it came from, weights' sha256."""
    src = spec.source or {}
    where = src.get("kind", "?") + (f" {src['path']}" if src.get("path") else "")
    return f"{shown(spec.name)} ({shown(where)}), weights sha256 {spec.model_sha256[:12]}"


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
              model_overrides: list[str] | None = None, model_name: str | None = None,
              timer: Callable[[str], ContextManager] | None = None) -> dict:
    """Kernel vs oracle on real K/V of the model the artifact names -> the runtime_check record. write=True (the
    run, on the artifact it is still writing) also records it in the manifest; `python -m pipeline check` passes
    write=False and never changes an artifact (main writes the record beside it). The artifact is read and verified
    whole (digest, schema, every checksum) before any model loads; then the model (model_bundle: a
    pipeline.model.LoadedModel, else the one the manifest's model.source names with model_overrides on top) is
    bound to it (weights, shapes, RoPE, tokenizer). kernel: the attention under test (DecodeInputs -> [B, H_q, D]);
    tests pass a faulty one. write=False (`check`): the model is model_config_for's (model_name: the user's
    `model=NAME`), its weights' sha256 must be the artifact's (cfg.allow_other_model: a deliberate transfer,
    recorded), the canary the artifact claims is required and re-measured (cfg.allow_unclaimed), and the record names
    the model judged on (`judged_on`). timer(name): a context manager timing each part ("load model", "runtime
    check", "quality canary"; the run passes Runner.step, `check` prints its own table)."""
    from exporters.compressed_tensors import is_checkpoint
    from exporters.native import load_artifact, update_manifest

    native = ensure_backend()  # Triton's interpreter chosen before anything imports triton
    cfg = cfg or CheckConfig()
    timer = timer or (lambda name: nullcontext())
    contexts = list(cfg.gpu_contexts if native else cfg.contexts)
    batches = list(cfg.batches)
    validate_check_options(contexts, batches, None, cfg.canary_tokens, cfg.max_kl, cfg.min_top1)  # before any load
    if is_checkpoint(artifact_dir):  # a vLLM checkpoint's sealed copy (kvcalib/): checked, never rewritten
        write = False
    artifact = load_artifact(artifact_dir)  # the whole folder verified, before the model
    if model_bundle is None:
        from pipeline.model import load_model
        model_cfg = model_config_for(artifact.manifest, model_overrides, model_name)
        refuse_malformed_model_config(model_cfg)
        with timer("load model"):
            model_bundle = load_model(model_cfg)
    other_model = bind_model(artifact.manifest, model_bundle.spec, cfg.allow_other_model)

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
    log(f"runtime check: {shown(artifact.manifest['recipe'])} for {shown(artifact.manifest['model']['name'])}, "
        f"contexts {contexts} x batches {batches}, {model_bundle.spec.n_layers} layers, {device_name()}")
    log(f"  judged on: {judged_on(model_bundle.spec)}"
        + ("; ANOTHER model than calibrated (allow_other_model=true)" if other_model else ""))
    cases, timing, error = [], {"kernel_s": 0.0, "oracle_s": 0.0}, None
    with timer("runtime check"):
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
        judged = not write and not other_model  # `check` judges the claim; a run is measuring it
        try:
            with timer("quality canary"):
                canary = quality_canary(artifact, model_bundle, cfg, log, judge_claim=judged,
                                        require_claim=judged and not cfg.allow_unclaimed, claims=not write)
        except CanaryCannotRun as exc:
            error = str(exc)
    elif not cfg.canary_tokens:
        log("  quality canary: off (canary_tokens=0): the verdict is the kernels' alone")
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
    if not write:  # the check record beside the artifact (not the manifest's runtime_check, whose schema is fixed)
        result["manifest_digest"] = artifact.manifest["manifest_digest"]  # export-vllm trusts only its own artifact's
        result["judged_on"] = {"model": judged_on(model_bundle.spec), "sha256": model_bundle.spec.model_sha256,
                               "source": model_bundle.spec.source, "other_model": other_model,
                               "allow_unclaimed": cfg.allow_unclaimed, "max_kl": cfg.max_kl,
                               "min_top1": cfg.min_top1}
    if write:
        update_manifest(artifact_dir, runtime_check=result)
    if passed:
        log(f"runtime check passed: max_abs_err {result['max_abs_err']:.3e}, max_rel_err "
            f"{result['max_rel_err']:.3e} <= rtol {RTOL:g} (Triton {triton.__version__}, {result['device']})")
    else:
        why = error or ("the quality canary " + canary["reason"] if canary is not None and not canary["ok"]
                        else "kernel and oracle disagree beyond the tolerance")
        log(f"runtime check FAILED: {why}")
    log(f"  verdict reached on {judged_on(model_bundle.spec)}")
    return result


def bind_model(manifest: dict, spec, allow_other_model: bool = False) -> bool:
    """The model loaded is the one the artifact was calibrated for: its weights' sha256 (config + weights) first,
    refused by name (ModelMismatchError, exit 2) unless allow_other_model (a deliberate transfer: then every other
    field -- shapes, RoPE, tokenizer -- must still agree); then exporters.manifest.check_model. -> True when the
    weights differ (allowed)."""
    import dataclasses

    from exporters.manifest import ModelMismatchError, check_model

    recorded = manifest["model"]["sha256"]
    other = spec.model_sha256 != recorded
    if other and not allow_other_model:
        raise ModelMismatchError(
            f"model/sha256: the artifact was calibrated for {shown(manifest['model']['name'])} with weights sha256 "
            f"{shown(recorded)[:12]}; the model loaded, {judged_on(spec)}, is another model. Pass the model it was "
            f"calibrated on (model.path=FOLDER or model=NAME), or allow_other_model=true to judge a deliberate "
            f"transfer")
    check_model(manifest, dataclasses.replace(spec, model_sha256=recorded) if other else spec)
    return other


class CanaryCannotRun(Exception):
    """The canary does not fit the model: a failed check (its error), never a skipped canary."""


def quality_canary(artifact, model_bundle, cfg: CheckConfig, log: Callable[[str], None], judge_claim: bool = True,
                   require_claim: bool = True, claims: bool = True) -> dict:
    """runtime_check/canary.py on the artifact's policy and the model: measured, then judged against the absolute
    limits (cfg.max_kl, cfg.min_top1), the canary the artifact claims (manifest runtime_check.canary: judge_claim,
    require_claim), the model's own prefix rows and the layers' flush units. A canary that cannot run is a failed
    one (never skipped). claims: print the artifact's claims (its recorded evaluation and canary) as claims -- not in
    the run, which is writing them."""
    from runtime_check import canary
    from runtime_check.check import artifact_prefix
    from serving.cache import prefix_rows

    policy, spec, manifest = artifact.policy, model_bundle.spec, artifact.manifest
    claim = (manifest.get("runtime_check") or {}).get("canary") if judge_claim else None
    if claims:
        show_claims(manifest, judge_claim, log)
    findings = canary.never_stored(policy, spec.max_positions)
    prefix, model_prefix = artifact_prefix(artifact), None
    if prefix is not None:
        import torch

        with torch.no_grad():
            computed = prefix_rows(policy, model_bundle.model, None)
        if why := canary.prefix_difference(prefix, computed):
            findings.append(why)
        model_prefix = {"ids": prefix["ids"], "k": computed[0], "v": computed[1]}  # the baseline's, computed once
    tokens = claim["tokens"] if claim and isinstance(claim.get("tokens"), int) else cfg.canary_tokens
    fit = canary.lengths(policy, spec.max_positions, tokens)
    if fit is None:
        raise CanaryCannotRun(f"the quality canary cannot run: the model's {spec.max_positions} positions cannot hold "
                              f"the artifact's prefix, sink, residual and stored rows and {canary.MIN_TOKENS} scored "
                              f"tokens")
    warmup, tokens = fit
    ids = eval_ids(model_bundle.tokenizer, 1, warmup + tokens)
    measured = canary.measure(model_bundle.model, policy, ids, warmup, prefix, model_prefix)
    result = canary.judge(measured, claim, cfg.max_kl, cfg.min_top1, require_claim, findings)
    log(f"  quality canary ({result['tokens']} tokens decoded after {result['warmup']}): KL "
        f"{result['kl']:.4g} nats, top-1 agreement {result['agreement']:.3f} (calibration-free at the same bits, for "
        f"reference: KL {result['baseline_kl']:.4g}) -> {result['reason']}")
    return result


def show_claims(manifest: dict, judged: bool, log: Callable[[str], None]) -> None:
    """The artifact's own records, printed as what they are: claims (re-signable by whoever wrote the artifact). The
    canary claim is re-measured by the canary; the evaluation is not (it needs the run's text and windows)."""

    ev = (manifest.get("evaluation") or {}).get(manifest["recipe"])
    if ev and "ppl_ratio" in ev:
        ci = ev.get("ppl_ratio_ci95")
        log(f"  claimed by the artifact, not measured here: perplexity x{ev['ppl_ratio']:.4f} of fp16"
            + (f" [{ci[0]:.4f}, {ci[1]:.4f}]" if ci else "") + f" for {shown(manifest['recipe'])}")
    else:
        log("  claimed by the artifact: no evaluation of its recipe")
    claim = (manifest.get("runtime_check") or {}).get("canary")
    if claim:
        log(f"  claimed canary: KL {claim.get('kl', float('nan')):.4g} nats, top-1 "
            f"{claim.get('agreement', float('nan')):.3f} over {claim.get('tokens')} tokens -- "
            + ("re-measured below" if judged else "not judged (another model)"))
    else:
        log("  claimed canary: none recorded")


def result_path(artifact_dir: str | Path) -> Path:
    """Where `check` writes its record by default: beside the artifact folder, never inside it
    (outputs/<date>/<time>/artifact -> outputs/<date>/<time>/artifact.check.json)."""
    directory = Path(artifact_dir).resolve()
    return directory.parent / f"{directory.name}.check.json"


USAGE = """usage: {prog} check ARTIFACT [model=NAME] [model.<field>=VALUE ...] [contexts=[64,200]] [batches=[1,2]]
                     [gpu_contexts=[...]] [max_kl=0.25] [min_top1=0.75] [allow_unclaimed=true]
                     [allow_other_model=true] [--out FILE]

Runs the runtime equivalence check on an exported artifact (or a vLLM checkpoint folder written by export-vllm):
the decode kernels (Triton; on a CPU also the fused C kernel) reading the artifact's stored cache against the
oracle, on real K/V of the model the artifact was calibrated on. The artifact is verified whole (digest, schema,
checksums) before the model loads, and is never modified.

  ARTIFACT                 the artifact folder (outputs/<date>/<time>/artifact) or a vLLM checkpoint folder
  model=NAME               judge on conf/model/NAME.yaml's model (e.g. model=llama3 model.path=FOLDER)
  model.<field>=VALUE      override where the model comes from; by default the model recorded in the
                           manifest (model.source), followed only to a model on this machine (an embedded
                           package, a folder, a cached hub snapshot) whose weights' sha256 is the artifact's;
                           never a download, never a random model unasked: e.g. model.path=/new/place/of/the/folder
  contexts, batches        the context lengths and batch sizes checked on a CPU (default [64,200] x [1,2])
  gpu_contexts             the context lengths checked on a GPU (default [64,200,1024,4096])
  canary_tokens            tokens of the quality canary (default 128; 0: off): text served through the
                           artifact's cache, KL and top-1 vs the model's own forward (docs/manifest.md)
  max_kl, min_top1         the canary's absolute limits (default 0.25 nats, 0.75): the artifact cannot move them
  allow_unclaimed=true     judge an artifact that records no canary of its run on the limits alone (by default
                           its claimed canary is required and re-measured: a claim worse than measured fails)
  allow_other_model=true   judge on a model with other weights than the artifact was calibrated on (a deliberate
                           transfer; printed in the verdict; the claims are then shown, not judged)
  --out FILE               where the record (JSON) goes; default ARTIFACT.check.json beside the folder

exit codes: 0 passed, 1 failed, 2 refused (artifact, model or option), 130 interrupted (Ctrl-C)
example: {prog} check outputs/2026-12-05/01-16-29/artifact
"""


class Parts:
    """Where `check`'s time goes: each part run_check times (the model's load, the runtime check, the canary) with
    other processes' share of the CPUs meanwhile (pipeline.runner.Usage), printed in one line, and the busy
    machine said (pipeline.runner.busy_line)."""

    def __init__(self) -> None:
        self.parts: list[tuple[str, object]] = []

    @contextmanager
    def part(self, name: str):
        from pipeline.runner import Usage

        with Usage() as use:
            yield
        self.parts.append((name, use))

    def line(self) -> str:
        from pipeline.runner import busy_line

        total = sum(u.wall_s for _, u in self.parts)
        out = "time: " + ", ".join(f"{n} {u.wall_s:.1f} s" for n, u in self.parts) + f" (timed total {total:.1f} s)"
        busy = busy_line([(u.wall_s, u.others_cpu) for _, u in self.parts])
        return out + (f"\n{busy}" if busy else "")


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
    try:
        if "--out" in rest:
            i = rest.index("--out")
            if i + 1 >= len(rest):
                raise UserError("--out needs a FILE")
            out = Path(path_argument(rest[i + 1], "--out"))
            del rest[i : i + 2]
        path_argument(args[0], "ARTIFACT")
    except UserError as exc:
        print(f"error: {shown(exc, MAX_REFUSAL_CHARS)}", file=sys.stderr)
        return EXIT_USER
    directory = args[0]
    timed = Parts()
    model_overrides = [a for a in rest if a.startswith("model.")]
    names = [a.removeprefix("model=") for a in rest if a.startswith("model=")]
    overrides = [a.removeprefix("check.") for a in rest if not a.startswith(("model.", "model="))]
    try:
        if not Path(directory).is_dir():
            raise UserError(f"ARTIFACT: no such folder {directory!r} (an artifact folder holds manifest.json and "
                            f"tensors.safetensors: outputs/<date>/<time>/artifact)")
        cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(CheckConfig), OmegaConf.from_dotlist(overrides)))
        if len(names) > 1:
            raise UserError(f"model=NAME: given {len(names)} times ({', '.join(names)}); allowed once")
        if names:
            from pipeline.config import model_names

            if names[0] not in model_names():
                raise UserError(f"model={names[0]!r}: allowed one of {model_names()} (conf/model/<name>.yaml), or "
                                f"model.path=FOLDER for a model folder")
        result = run_check(directory, cfg=cfg, write=False, model_overrides=model_overrides,
                           model_name=names[0] if names else None, timer=timed.part)
    except OmegaConfBaseException as exc:
        print(f"error: invalid check option: {exc}", file=sys.stderr)
        return EXIT_USER
    except user_errors() as exc:  # the strict loader refused the artifact, or an option / the model was refused
        print(f"error: {shown(directory)}: {type(exc).__name__}: {shown(exc, MAX_REFUSAL_CHARS)}", file=sys.stderr)
        return EXIT_USER
    target = out or result_path(directory)
    atomic_write_json(target, result)
    print(timed.line())
    print(f"check record: {target}")
    return EXIT_OK if result["status"] == "passed" else EXIT_CHECK_FAILED


__all__ = ["run_check", "main", "result_path", "USAGE", "triton_kernel", "model_config_for", "judged_on",
           "bind_model", "quality_canary", "show_claims", "CanaryCannotRun", "RANDOM_SOURCES",
           "refuse_malformed_model_config", "eval_ids", "ensure_backend", "device_name",
           "RuntimeCheckError"]
