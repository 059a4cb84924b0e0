"""`python -m pipeline <run|check|show> [hydra overrides]`."""
from __future__ import annotations

import sys
from pathlib import Path

USAGE = """usage: python -m pipeline <command> [key=value ...]

commands:
  run     calibrate, evaluate and export (Hydra overrides: model=smollm2|llama3|tiny data=embedded|local|hub
          quant=<recipe> data.n_samples=16 ...; `run --help` shows the full config, `run -m ...` sweeps)
  check   DIR   run the runtime equivalence check on an exported artifact
  show    DIR_OR_RUN_ID   print an artifact's or a run's summary and lineage
"""
COMMANDS = ("run", "check", "show")
EXIT_GATE = 4


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        sys.exit(0 if argv else 2)
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"error: unknown command {command!r}; allowed: {', '.join(COMMANDS)}\n\n{USAGE}", file=sys.stderr)
        sys.exit(2)
    if command == "run":
        sys.argv = [sys.argv[0], *rest]
        _hydra_run()
        return
    if not rest:
        print(f"error: `{command}` needs a DIR argument", file=sys.stderr)
        sys.exit(2)
    sys.exit(_show(rest) if command == "show" else _check(rest))


def _show(args: list[str]) -> int:
    from exporters.manifest import ManifestError

    target = args[0]
    try:
        if Path(target).is_dir():
            from pipeline.show import show_artifact
            print(show_artifact(target))
            return 0
        return _show_run(target, args[1:])
    except ManifestError as exc:
        print(f"error: {target}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2


def _show_run(run_id: str, args: list[str]) -> int:
    import os

    from pipeline.errors import UserError
    from pipeline.tracking import EXIT_UNREACHABLE, TrackingError, show_run

    uri = next((a.split("=", 1)[1] for a in args if a.startswith("tracking.uri=")),
               os.environ.get("MLFLOW_TRACKING_URI", "sqlite:///mlruns.db"))
    try:
        print(show_run(run_id, uri))
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except TrackingError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_UNREACHABLE
    return 0


def _check(args: list[str]) -> int:
    """`check DIR [contexts=[..]] [batches=[..]]`: 0 passed, 1 failed, 2 refused (runtime_check/check.py)."""
    from runtime_check.check import main as check_main
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
    """Typed config -> pipeline run recorded in MLflow; user errors become one line on stderr and exit code 2,
    an unreachable tracking store (results still written) exit code 3."""
    from omegaconf.errors import OmegaConfBaseException

    from pipeline.config import to_typed
    from pipeline.errors import UserError
    from pipeline.tracking import EXIT_UNREACHABLE, TrackingError, tracked_run
    from pipeline.app import GateError
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
        return 2
    except (UserError, NonFiniteError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except TrackingError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_UNREACHABLE
    except GateError as exc:  # the artifact, summary and report are written; the run is marked failed
        print(f"error: {exc}\nresults: {run_dir.resolve()}", file=sys.stderr)
        return EXIT_GATE
    print(f"results: {run_dir.resolve()}")
    return 0
