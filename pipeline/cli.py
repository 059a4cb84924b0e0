"""`kvcalib <command> [hydra overrides]`, or `python -m pipeline <command> ...`: the same commands and exit codes
(pyproject.toml [project.scripts] points the console script at `main`)."""
from __future__ import annotations

import sys
from pathlib import Path

from pipeline.errors import EXIT_CHECK_FAILED, EXIT_GATE, EXIT_INTERNAL, EXIT_OK, EXIT_UNREACHABLE, EXIT_USER

USAGE = """usage: {prog} <command> [key=value ...]

commands:
  run     calibrate, evaluate and export (Hydra overrides: model=smollm2|llama3|tiny data=embedded|local|hub
          quant=<recipe> data.n_samples=16 ...; `run --help` shows the full config, `run -m ...` sweeps)
  check   DIR   run the runtime equivalence check on an exported artifact
  show    DIR_OR_RUN_ID   print an artifact's or a run's summary and lineage
  export-vllm  ARTIFACT OUT [model.path=... model.source=...] [--overwrite]
          write a checkpoint folder vLLM serves as is (fp8 e4m3 per-tensor artifacts; docs/vllm.md)
  recommend  RUN_DIR   the cheapest vLLM --kv-cache-dtype (or, --engine llama.cpp, -ctk/-ctv pair) within the
                       run's drift gate, with its `vllm serve` (`llama-server`) line
"""
COMMANDS = ("run", "check", "show", "export-vllm", "recommend")
CONSOLE_SCRIPT = "kvcalib"


def prog() -> str:
    """How the user called us, for usage lines: the console script or `python -m pipeline`."""
    return CONSOLE_SCRIPT if Path(sys.argv[0]).name == CONSOLE_SCRIPT else "python -m pipeline"


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    usage = USAGE.format(prog=prog())
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage)
        sys.exit(EXIT_OK if argv else EXIT_USER)
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"error: unknown command {command!r}; allowed: {', '.join(COMMANDS)}\n\n{usage}", file=sys.stderr)
        sys.exit(EXIT_USER)
    if command == "run":
        sys.argv = [sys.argv[0], *rest]
        sys.exit(_hydra_run())
    if not rest:
        print(f"error: `{command}` needs a DIR argument", file=sys.stderr)
        sys.exit(EXIT_USER)
    try:
        code = {"show": _show, "check": _check, "export-vllm": _export_vllm, "recommend": _recommend}[command](rest)
    except Exception as exc:  # noqa: BLE001 -- what no handler expected is a bug: its own code, never EXIT_USER's
        code = internal_error(exc)
    sys.exit(code)


def internal_error(exc: BaseException) -> int:
    """An exception no handler expected: the traceback, one line naming it, EXIT_INTERNAL (not EXIT_USER, which
    says the input was wrong, nor EXIT_CHECK_FAILED, which Python's own exit status 1 would say)."""
    import traceback

    traceback.print_exception(type(exc), exc, exc.__traceback__)
    print(f"error: internal error (a bug, not bad input): {type(exc).__name__}: {exc}", file=sys.stderr)
    return EXIT_INTERNAL


def _show(args: list[str]) -> int:
    from pipeline.errors import user_errors

    target = args[0]
    try:
        if Path(target).is_dir():
            from pipeline.show import show_artifact
            print(show_artifact(target))
            return EXIT_OK
        return _show_run(target, args[1:])
    except user_errors() as exc:  # the strict loader refused the artifact, or no such run
        print(f"error: {target}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_USER


def _show_run(run_id: str, args: list[str]) -> int:
    import os

    from pipeline.errors import UserError
    from pipeline.tracking import TrackingError, show_run

    uri = next((a.split("=", 1)[1] for a in args if a.startswith("tracking.uri=")),
               os.environ.get("MLFLOW_TRACKING_URI", "sqlite:///mlruns.db"))
    try:
        print(show_run(run_id, uri))
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USER
    except TrackingError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_UNREACHABLE
    return EXIT_OK


def _check(args: list[str]) -> int:
    """`check DIR [contexts=[..]] [batches=[..]]`: EXIT_OK passed, EXIT_CHECK_FAILED failed, EXIT_USER refused
    (pipeline/check.py)."""
    from pipeline.check import main as check_main
    return check_main(args)


def _export_vllm(args: list[str]) -> int:
    """`export-vllm ARTIFACT OUT [model.<field>=...] [--overwrite]`: the model the artifact names
    (conf/model/<name>.yaml, fields overridable), checked against the artifact's model identity, then
    pipeline.export.write_vllm_checkpoint, and the serve line of the folder's kind (fp8: vLLM's own fp8 cache;
    packed: the kvcalib vLLM plugin). EXIT_USER for a refused artifact, recipe, model or argument."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from exporters.compressed_tensors import checkpoint_kind
    from exporters.native import load_artifact, read_manifest
    from pipeline.check import model_config_for
    from pipeline.errors import UserError, user_errors

    overwrite = "--overwrite" in args
    rest = [a for a in args if a != "--overwrite"]
    positional = [a for a in rest if "=" not in a]
    overrides = [a.removeprefix("model.") for a in rest if "=" in a]
    if len(positional) != 2 or any(not a.startswith("model.") for a in rest if "=" in a):
        print(f"error: usage: {prog()} export-vllm ARTIFACT OUT [model.<field>=VALUE ...] [--overwrite]",
              file=sys.stderr)
        return EXIT_USER
    artifact_dir, out = (Path(a) for a in positional)
    try:
        from pipeline.export import write_vllm_checkpoint
        from pipeline.model import load_model, source_directory

        manifest = read_manifest(artifact_dir)
        cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(model_config_for(manifest)),
                                                  OmegaConf.from_dotlist(overrides)))
        if cfg.name != manifest["model"]["name"]:
            raise UserError(f"model.name: the artifact was calibrated on {manifest['model']['name']!r}, got {cfg.name!r}")
        lm = load_model(cfg)
        path = write_vllm_checkpoint(out, artifact_dir, lm, source_directory(cfg), overwrite=overwrite)
        kind = checkpoint_kind(load_artifact(artifact_dir, lm.spec).policy)
    except OmegaConfBaseException as exc:
        print(f"error: invalid model option: {exc}", file=sys.stderr)
        return EXIT_USER
    except user_errors() as exc:
        print(f"error: {artifact_dir}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_USER
    if kind == "fp8":
        print(f"vllm checkpoint: {path.resolve()}\nserve: vllm serve {path.resolve()} --kv-cache-dtype fp8")
    else:
        print(f"vllm checkpoint (packed, served by the kvcalib vLLM plugin): {path.resolve()}\n"
              f"serve: vllm serve {path.resolve()} --kv-cache-dtype auto\n"
              f"requires: the kvcalib vLLM plugin installed in vLLM's environment (`pip install kvcalib` there; "
              f"scripts/install-vllm.sh does it); --kv-cache-dtype auto: the plugin stores the cache itself")
    return EXIT_OK


def _recommend(args: list[str]) -> int:
    from pipeline.errors import user_errors
    from pipeline.recommend import recommend_main

    try:
        print(recommend_main(args))
    except user_errors() as exc:
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_USER
    return EXIT_OK


def _hydra_run() -> int:
    """Hydra composes the config and calls run_from_dictconfig (once per job under `-m`), whose exit code ends
    the process. What Hydra itself refuses before that -- an unknown group option or key, a malformed override --
    it would print and exit with status 1, EXIT_CHECK_FAILED's code; HYDRA_FULL_ERROR=1 makes it raise instead,
    so such a refusal exits EXIT_USER with Hydra's message, and anything else EXIT_INTERNAL."""
    import os

    import hydra
    from omegaconf import DictConfig

    from pipeline.config import register_configs
    from pipeline.errors import user_errors

    register_configs()
    conf_dir = str(Path(__file__).resolve().parent.parent / "conf")

    @hydra.main(config_path=conf_dir, config_name="config", version_base="1.3")
    def _app(cfg: DictConfig) -> None:
        from hydra.core.hydra_config import HydraConfig

        code = run_from_dictconfig(cfg, Path(HydraConfig.get().runtime.output_dir))
        if code:
            sys.exit(code)

    previous = os.environ.get("HYDRA_FULL_ERROR")
    os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        _app()
    except user_errors() as exc:
        print(f"error: invalid command line or config: {_config_message(exc)}", file=sys.stderr)
        return EXIT_USER
    except Exception as exc:  # noqa: BLE001
        return internal_error(exc)
    finally:
        if previous is None:
            os.environ.pop("HYDRA_FULL_ERROR", None)
        else:
            os.environ["HYDRA_FULL_ERROR"] = previous
    return EXIT_OK


def _config_message(exc: BaseException) -> str:
    """Hydra's message and the OmegaConf error under it (what Hydra prints itself), without its hint to append a
    key with `+key=value`: the schema refuses unknown keys either way."""
    from omegaconf.errors import OmegaConfBaseException

    parts = [str(exc)]
    if isinstance(exc.__cause__, OmegaConfBaseException) and str(exc.__cause__) not in parts[0]:
        parts.append(str(exc.__cause__))
    lines = "\n".join(parts).splitlines()
    return "\n".join(line for line in lines if not line.startswith("To append to your config use +"))


def run_from_dictconfig(cfg, run_dir: Path) -> int:
    """Typed config -> pipeline run recorded in MLflow -> an exit code (pipeline/errors.py). Each error becomes one
    line on stderr: a failed runtime check EXIT_CHECK_FAILED (as `check` exits), an unreachable tracking store
    EXIT_UNREACHABLE and a failed drift gate EXIT_GATE (results still written), bad input (user_errors())
    EXIT_USER; anything else is a bug: its traceback and EXIT_INTERNAL."""
    from omegaconf.errors import OmegaConfBaseException

    from pipeline.config import to_typed
    from pipeline.errors import GateError, RuntimeCheckError, user_errors
    from pipeline.tracking import TrackingError, tracked_run

    try:
        typed = to_typed(cfg)
        from pipeline.app import run_pipeline
        with tracked_run(typed, run_dir) as recorder:  # a stage that raises marks the MLflow run FAILED
            try:
                out = run_pipeline(typed, run_dir)
            except GateError as exc:  # results exist: log them, and the run still ends FAILED with the error
                if getattr(exc, "out", None) is not None:
                    recorder.record(exc.out)
                raise
            recorder.record(out)
    except RuntimeCheckError as exc:  # the manifest and summary record the failed check
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_CHECK_FAILED
    except TrackingError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_UNREACHABLE
    except GateError as exc:  # the artifact, summary and report are written; the run is marked failed
        print(f"error: {exc}\nresults: {run_dir.resolve()}", file=sys.stderr)
        return EXIT_GATE
    except user_errors() as exc:
        what = "invalid config: " if isinstance(exc, OmegaConfBaseException) else ""
        print(f"error: {what}{exc}", file=sys.stderr)
        return EXIT_USER
    except Exception as exc:  # noqa: BLE001 -- a bug, reported as one; the MLflow run is already marked FAILED
        return internal_error(exc)
    print(f"results: {run_dir.resolve()}")
    return EXIT_OK
