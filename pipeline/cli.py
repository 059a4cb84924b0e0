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
    print(f"error: `{command}` is not available yet", file=sys.stderr)
    sys.exit(2)


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
    """Typed config -> pipeline run; user errors become one line on stderr and exit code 2."""
    from omegaconf.errors import OmegaConfBaseException

    from pipeline.config import to_typed
    from pipeline.errors import UserError
    from stages.base import NonFiniteError

    try:
        typed = to_typed(cfg)
        from pipeline.app import run_pipeline
        run_pipeline(typed, run_dir)
    except OmegaConfBaseException as exc:
        print(f"error: invalid config: {exc}", file=sys.stderr)
        return 2
    except (UserError, NonFiniteError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"results: {run_dir.resolve()}")
    return 0
