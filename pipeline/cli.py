"""`python -m pipeline <run|check|show> [hydra overrides]`."""
from __future__ import annotations

import sys
from pathlib import Path

from pipeline.errors import EXIT_CHECK_FAILED, EXIT_GATE, EXIT_OK, EXIT_UNREACHABLE, EXIT_USER

USAGE = """usage: python -m pipeline <command> [key=value ...]

commands:
  run     calibrate, evaluate and export (Hydra overrides: model=smollm2|llama3|tiny data=embedded|local|hub
          quant=<recipe> data.n_samples=16 ...; `run --help` shows the full config, `run -m ...` sweeps)
  check   DIR   run the runtime equivalence check on an exported artifact
  show    DIR_OR_RUN_ID   print an artifact's or a run's summary and lineage
"""
COMMANDS = ("run", "check", "show")


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        sys.exit(EXIT_OK if argv else EXIT_USER)
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"error: unknown command {command!r}; allowed: {', '.join(COMMANDS)}\n\n{USAGE}", file=sys.stderr)
        sys.exit(EXIT_USER)
    if command == "run":
        sys.argv = [sys.argv[0], *rest]
        _hydra_run()
        return
    if not rest:
        print(f"error: `{command}` needs a DIR argument", file=sys.stderr)
        sys.exit(EXIT_USER)
    sys.exit(_show(rest) if command == "show" else _check(rest))


def _show(args: list[str]) -> int:
    from exporters.manifest import ManifestError

    target = args[0]
    try:
        if Path(target).is_dir():
            from pipeline.show import show_artifact
            print(show_artifact(target))
            return EXIT_OK
        return _show_run(target, args[1:])
    except ManifestError as exc:
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


def _hydra_run() -> None:
    import hydra
    from omegaconf import DictConfig

    from pipeline.config import register_configs

    register_configs()
    conf_dir = str(Path(__file__).resolve().parent.parent / "conf")

    @hydra.main(config_path=conf_dir, config_name="config", version_base="1.3")
    def _app(cfg: DictConfig) -> None:
        from hydra.core.hydra_config import HydraConfig

        code = run_from_dictconfig(cfg, Path(HydraConfig.get().runtime.output_dir))
        if code:
            sys.exit(code)

    _app()


def run_from_dictconfig(cfg, run_dir: Path) -> int:
    """Typed config -> pipeline run recorded in MLflow -> an exit code (pipeline/errors.py). Each error becomes one
    line on stderr: user errors EXIT_USER, a failed runtime check EXIT_CHECK_FAILED (as `check` exits), an
    unreachable tracking store EXIT_UNREACHABLE and a failed drift gate EXIT_GATE (results still written)."""
    from omegaconf.errors import OmegaConfBaseException

    from pipeline.config import to_typed
    from pipeline.errors import GateError, RuntimeCheckError, UserError
    from pipeline.tracking import TrackingError, tracked_run
    from stages.base import NonFiniteError

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
    except OmegaConfBaseException as exc:
        print(f"error: invalid config: {exc}", file=sys.stderr)
        return EXIT_USER
    except RuntimeCheckError as exc:  # the manifest and summary record the failed check
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_CHECK_FAILED
    except (UserError, NonFiniteError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USER
    except TrackingError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_UNREACHABLE
    except GateError as exc:  # the artifact, summary and report are written; the run is marked failed
        print(f"error: {exc}\nresults: {run_dir.resolve()}", file=sys.stderr)
        return EXIT_GATE
    print(f"results: {run_dir.resolve()}")
    return EXIT_OK
