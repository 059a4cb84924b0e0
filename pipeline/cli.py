"""`kvcalib <command> [hydra overrides]`, or `python -m pipeline <command> ...`: the same commands and exit codes
(pyproject.toml [project.scripts] points the console script at `main`)."""
from __future__ import annotations

import re
import sys
from pathlib import Path

from pipeline.errors import (EXIT_CHECK_FAILED, EXIT_GATE, EXIT_INTERNAL, EXIT_INTERRUPTED, EXIT_OK,
                             EXIT_UNREACHABLE, EXIT_USER)

USAGE = """usage: {prog} <command> [arguments]

commands:
  run          calibrate a KV-cache recipe on a model, evaluate it and export the artifact (recorded in MLflow)
  check        run the runtime equivalence check on an exported artifact (never modifies it)
  show         print an artifact's or an MLflow run's summary and lineage
  export-vllm  write a model folder vLLM serves as is, from an artifact
  recommend    the cheapest vLLM (or llama.cpp) KV cache within a run's drift gate, and the command serving it

`{prog} <command> --help` shows a command's arguments, options and an example.
example: {prog} run model=llama3 model.path=/path/to/your/model
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
    if "-h" in rest or "--help" in rest:  # before the command imports, loads or creates anything
        print(command_help(command))
        sys.exit(EXIT_OK)
    try:
        code = _command(command, rest)
    except KeyboardInterrupt:  # Ctrl-C: one line, not Python's traceback
        code = interrupted(command, rest)
    sys.exit(code)


def _command(command: str, rest: list[str]) -> int:
    """Run one command (its arguments `rest`) -> its exit code (pipeline/errors.py)."""
    if command == "run":
        refused = refuse_unusable_paths(command, rest)
        if refused is not None:
            return refused
        sys.argv = [sys.argv[0], *rest]
        return _hydra_run()
    if not rest:
        print(f"error: `{command}` needs a DIR argument", file=sys.stderr)
        return EXIT_USER
    refused = refuse_unusable_paths(command, rest)
    if refused is not None:
        return refused
    try:
        return {"show": _show, "check": _check, "export-vllm": _export_vllm, "recommend": _recommend}[command](rest)
    except Exception as exc:  # noqa: BLE001 -- what no handler expected is a bug: its own code, never EXIT_USER's
        return internal_error(exc)


# what an interrupted command leaves, and what the same command line does again (the line `interrupted` prints)
INTERRUPTED = {
    "run": "finished stages are kept: the same command resumes",
    "check": "the artifact is unchanged and no check record was written: the same command checks it again",
    "show": "nothing was changed: the same command shows it again",
    "export-vllm": "no partial OUT folder is left (it is written whole or not at all): the same command exports it",
    "recommend": "nothing was changed: the same command recommends again",
}


def interrupted(command: str, args: list[str]) -> int:
    """Ctrl-C (KeyboardInterrupt) during `command`: EXIT_INTERRUPTED, with one line on stderr saying what is kept
    and the user's own command line, quoted as a shell reads it, that takes it up again. By then the command's own
    cleanup has run as the exception passed: `run`'s MLflow run is marked KILLED (pipeline.tracking.tracked_run),
    its finished stages are in the stage cache (pipeline/runner.py) and a second run reuses them; export-vllm's
    temporary folder is removed (pipeline.export.write_vllm_checkpoint); check writes its record only at its end."""
    import shlex

    again = " ".join([prog(), *(shlex.quote(a) for a in [command, *args])])
    print(f"interrupted; {INTERRUPTED[command]}: {again}", file=sys.stderr)
    return EXIT_INTERRUPTED


# each command's positional arguments as its usage names them; the options whose next argument is their value
POSITIONAL = {"show": ("ARTIFACT",), "check": ("ARTIFACT",), "export-vllm": ("ARTIFACT", "OUT"),
              "recommend": ("RUN_DIR",)}
VALUE_OPTIONS = ("--platform", "--engine", "--max-ppl-ratio")   # recommend's (values, not paths)
PATH_OPTIONS = ("--out",)                                       # check's: a path
PATH_KEYS = ("model.path", "data.path")                         # key=PATH (run: both; the others: model.path)


def path_arguments(command: str, args: list[str]) -> list[tuple[str, str]]:
    """(name, value) of every path a command line of `command` gives: its positional arguments named as its usage
    names them (ARTIFACT, OUT, RUN_DIR; any further one "argument"), --out FILE and model.path=DIR."""
    names, out, i = iter(POSITIONAL.get(command, ())), [], 0
    while i < len(args):
        arg = args[i]
        if arg in VALUE_OPTIONS + PATH_OPTIONS:
            if arg in PATH_OPTIONS and i + 1 < len(args):
                out.append((arg, args[i + 1]))
            i += 2
            continue
        key, sep, value = arg.partition("=")
        if sep and key in PATH_KEYS:
            out.append((key, value))
        elif not sep and not arg.startswith("-"):
            out.append((next(names, "argument"), arg))
        i += 1
    return out


def refuse_unusable_paths(command: str, args: list[str]) -> int | None:
    """EXIT_USER, with one line naming the argument, for a path the system cannot look up at all (longer than
    PATH_MAX, a component longer than NAME_MAX, a loop of links: pipeline.errors.path_argument), before the command
    stats it and fails with OSError (EXIT_INTERNAL); None: every path can be looked up (existing or not)."""
    from pipeline.errors import UserError, path_argument, refusal_text

    try:
        for what, value in path_arguments(command, args):
            path_argument(value, what)
    except UserError as exc:
        print(f"error: {refusal_text(exc)}", file=sys.stderr)
        return EXIT_USER
    return None


def internal_error(exc: BaseException) -> int:
    """An exception no handler expected: the traceback, one line naming it, EXIT_INTERNAL (not EXIT_USER, which
    says the input was wrong, nor EXIT_CHECK_FAILED, which Python's own exit status 1 would say)."""
    import traceback

    traceback.print_exception(type(exc), exc, exc.__traceback__)
    print(f"error: internal error (a bug, not bad input): {type(exc).__name__}: {exc}", file=sys.stderr)
    return EXIT_INTERNAL


# ---------------------------------------------------------------------------------------------- --help
# Each command's help: its usage, arguments, options and an example, printed before the command imports, loads
# or creates anything (no torch, no MLflow; `show --help` opens no tracking store). check, export-vllm and
# recommend keep theirs beside their code (USAGE in pipeline/check.py, export_vllm.py, recommend.py: modules light
# at their top); run's is read from the config groups and the schema (pipeline/preflight.py), show's is here.

SHOW_USAGE = """usage: {prog} show ARTIFACT | RUN_ID [tracking.uri=URI]

Prints an artifact's summary and lineage (model, recipe, per-layer formats, evaluation, runtime check, data,
stages), read through the strict loader; or, given an MLflow run id, that run's record read back from MLflow.

  ARTIFACT           an artifact folder (outputs/<date>/<time>/artifact)
  RUN_ID             an MLflow run id, 32 hexadecimal digits (printed by `run` as `mlflow: run RUN_ID ...`; the
                     MLflow UI shows it); an argument with a '/' or a leading '.' or '~' is a folder, never a run id
  tracking.uri=URI   the MLflow store to read RUN_ID from (default: $MLFLOW_TRACKING_URI, else
                     sqlite:///mlruns.db in the working folder)

exit codes: 0 shown, 2 refused (no such artifact or run), 3 the tracking store could not be reached,
130 interrupted (Ctrl-C)
example: {prog} show outputs/2026-12-05/01-16-29/artifact
"""

RUN_USAGE = """usage: {prog} run [GROUP=OPTION ...] [KEY=VALUE ...] [-m]

Calibrates a KV-cache recipe on a model, evaluates it against fp16 and the comparison recipes (eval.recipes),
exports the artifact and records the run in MLflow (tracking.*). Results: outputs/<date>/<time>/ (summary.json,
report.md, artifact/). A key, option, recipe or model folder that does not exist is refused before anything runs.

config groups (conf/GROUP/OPTION.yaml; * marks the default):
{groups}
  your own model: model=llama3 model.path=DIR (a Hugging Face folder, as save_pretrained writes it), or
  model.source=local model.path=DIR. quant= takes a recipe a run exports; the evaluation-only ones (serving
  engines' own caches, e.g. vllm-*, hf-*; rotations, +rot) go in eval.recipes=[...].

config keys (GROUP.KEY=VALUE, e.g. data.n_samples=8; the schema is pipeline/config.py):
{keys}

options:
  -m, --multirun   one job per combination of comma-separated values (quant=a,b data.n_samples=8,16), each a
                   child of one MLflow parent run
  --cfg job        print the composed config (every value) instead of running
  --hydra-help     Hydra's own options (--info, --config-dir, ...)

exit codes: 0 done, 1 runtime check failed, 2 refused, 3 tracking store unreachable, 4 drift gate failed, 5 a bug,
130 interrupted (Ctrl-C: finished stages are kept, the same command resumes); README.md "Exit codes"
example: {prog} run model=llama3 model.path=/path/to/your/model quant=kvquant-4b-1pct data.n_samples=8
"""


def command_help(command: str) -> str:
    """`<command> --help`: the command's usage, arguments, options and one example."""
    if command == "run":
        return run_help()
    if command == "show":
        return SHOW_USAGE.format(prog=prog())
    import importlib

    module = {"check": "pipeline.check", "export-vllm": "pipeline.export_vllm",
              "recommend": "pipeline.recommend"}[command]
    return importlib.import_module(module).USAGE.format(prog=prog())


def run_help() -> str:
    """RUN_USAGE with the config groups' options (conf/) and the schema's keys (pipeline/preflight.py). A group of
    more options than a refusal lists (preflight.LISTED_AT_MOST: the recipes, which a misspelled quant= points
    here for) is printed a family to a line (option_families)."""
    import textwrap

    from pipeline import preflight

    def block(label: str, items: list[str], indent: int = 2) -> str:
        return textwrap.fill(", ".join(items), width=116, initial_indent=" " * indent + f"{label:<{17 - indent}}",
                             subsequent_indent=" " * 17, break_on_hyphens=False, break_long_words=False)

    def group(name: str) -> str:
        options = [o + ("*" if defaults.get(name) == o else "") for o in preflight.group_options(name)]
        if len(options) <= preflight.LISTED_AT_MOST:
            return block(f"{name}=", options)
        return "\n".join([f"  {name + '=':<15}{len(options)} options, by family:"]
                         + [block(family, names, indent=4) for family, names in option_families(options).items()])

    defaults = preflight.default_options()
    order = [g for g in defaults if g in preflight.groups()] + [g for g in preflight.groups() if g not in defaults]
    groups = [group(g) for g in order]
    schema = preflight.schema()
    keys = [block(f"{name}.", [k + (".*" if sub.children else "") for k, sub in key.children.items()])
            for name, key in schema.items() if key.children]
    keys.append(block("(top level)", [name for name, key in schema.items() if not key.children]))
    return RUN_USAGE.format(prog=prog(), groups="\n".join(groups), keys="\n".join(keys))


def option_families(options: list[str]) -> dict[str, list[str]]:
    """A long option list grouped for reading, in its order: by the name's first word without its digits (fp16 and
    fp8-e4m3: fp; int2-token: int; vllm-*, hf-*, kivi-*); a family itself longer than preflight.LISTED_AT_MOST
    split again by the second word (kvquant: kvquant-2b, kvquant-4b, kvquant-k3v4, ...)."""
    from pipeline.preflight import LISTED_AT_MOST

    def words(name: str) -> list[str]:
        return name.split("+")[0].split("-")

    first: dict[str, list[str]] = {}
    for name in options:
        first.setdefault(re.sub(r"\d.*", "", words(name)[0]) or words(name)[0], []).append(name)
    out: dict[str, list[str]] = {}
    for family, names in first.items():
        for name in names:
            split = len(names) > LISTED_AT_MOST and len(words(name)) > 1
            out.setdefault(f"{family}-{words(name)[1]}" if split else family, []).append(name)
    return out


RUN_ID = re.compile(r"[0-9a-f]{32}")   # an MLflow run id: uuid4().hex, as `run` prints it (mlflow: run RUN_ID)


def show_target(target: str) -> str:
    """What `show TARGET` names: "artifact" (an existing folder) or "run" (an MLflow run id), told apart before
    MLflow is consulted (opening a store takes most of a minute). Refused at once (UserError) otherwise: a path --
    a separator in it, or a leading '.' or '~' -- that is no existing folder; anything else that is no run id, with
    both readings said."""
    import os

    from pipeline.errors import UserError, path_argument, shown

    path = path_argument(target, "ARTIFACT")
    if path.is_dir():
        return "artifact"
    separators = {os.sep, os.altsep or os.sep, "/"}
    if any(sep in target for sep in separators) or target.startswith((".", "~")):
        what = "is not a folder" if path.exists() else "no such folder"
        raise UserError(f"ARTIFACT: {what}: {shown(target)} (an artifact folder holds manifest.json and "
                        f"tensors.safetensors: outputs/<date>/<time>/artifact)")
    if RUN_ID.fullmatch(target):
        return "run"
    raise UserError(f"{shown(target)} is neither an artifact folder (no folder of that name here) nor an MLflow run "
                    f"id (32 lowercase hexadecimal digits, as `run` prints it: `mlflow: run RUN_ID ...`)")


def _show(args: list[str]) -> int:
    from pipeline.errors import UserError, refusal_text, shown, user_errors

    target = args[0]
    if hasattr(sys.stdout, "reconfigure"):  # a manifest's text on a terminal that cannot encode it: escaped
        sys.stdout.reconfigure(errors="backslashreplace")
    try:
        kind = show_target(target)
    except UserError as exc:  # the argument names neither an artifact folder nor a run: its message says which
        print(f"error: {refusal_text(exc)}", file=sys.stderr)
        return EXIT_USER
    if kind == "run":
        return _show_run(target, args[1:])
    try:
        from pipeline.show import show_artifact
        print(show_artifact(target))
    except user_errors() as exc:  # the strict loader refused the artifact
        print(f"error: {shown(target)}: {type(exc).__name__}: {refusal_text(exc)}", file=sys.stderr)
        return EXIT_USER
    return EXIT_OK


def _show_run(run_id: str, args: list[str]) -> int:
    import os

    from pipeline.errors import UserError, refusal_text
    from pipeline.tracking import TrackingError, show_run

    uri = next((a.split("=", 1)[1] for a in args if a.startswith("tracking.uri=")),
               os.environ.get("MLFLOW_TRACKING_URI", "sqlite:///mlruns.db"))
    try:
        print(show_run(run_id, uri))
    except UserError as exc:
        print(f"error: {refusal_text(exc)}", file=sys.stderr)
        return EXIT_USER
    except TrackingError as exc:
        print(f"error: {refusal_text(exc)}", file=sys.stderr)
        return EXIT_UNREACHABLE
    return EXIT_OK


def _check(args: list[str]) -> int:
    """`check DIR [contexts=[..]] [batches=[..]]`: EXIT_OK passed, EXIT_CHECK_FAILED failed, EXIT_USER refused
    (pipeline/check.py)."""
    from pipeline.check import main as check_main
    return check_main(args)


def _export_vllm(args: list[str]) -> int:
    """`export-vllm ARTIFACT OUT [model.<field>=...] [--overwrite]`: pipeline/export_vllm.py."""
    from pipeline.export_vllm import main as export_vllm_main
    return export_vllm_main(args, prog())


def _recommend(args: list[str]) -> int:
    from pipeline.errors import refusal_text, user_errors
    from pipeline.recommend import recommend_main

    try:
        print(recommend_main(args, prog()))
    except user_errors() as exc:
        print(f"error: {type(exc).__name__}: {refusal_text(exc)}", file=sys.stderr)
        return EXIT_USER
    return EXIT_OK


def _hydra_run() -> int:
    """Hydra composes the config and calls run_from_dictconfig (once per job under `-m`), whose exit code ends
    the process. First _refuse_before_hydra: a command line it refuses leaves no run folder and no MLflow run.
    What Hydra itself refuses (on a command line left to it: --config-dir, a glob sweep, ...) it would print and
    exit with status 1, EXIT_CHECK_FAILED's code; HYDRA_FULL_ERROR=1 makes it raise instead, so such a refusal
    exits EXIT_USER with Hydra's message, and anything else EXIT_INTERNAL."""
    import os

    refused = _refuse_before_hydra(sys.argv[1:])
    if refused is not None:
        return refused

    import hydra
    from omegaconf import DictConfig

    from pipeline.config import register_configs
    from pipeline.errors import user_errors
    from pipeline.preflight import CONF_DIR

    register_configs()
    conf_dir = str(CONF_DIR)

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


# Hydra's flags that run jobs; any other (--cfg, --info, --hydra-help, --config-dir, ...) leaves the command line
# to Hydra alone
HYDRA_RUN_FLAGS = ("-m", "--multirun", "-r", "--run")


def _refuse_before_hydra(args: list[str]) -> int | None:
    """EXIT_USER, with one message, for what a `run` command line gets wrong, found before Hydra creates a run
    folder or an MLflow run exists: first what its text shows (pipeline/preflight.py: keys, group options, model
    folder; no torch, in well under a second), then each job's config composed as Hydra will compose it and
    validated whole (pipeline.config.validate_run). None: nothing refused."""
    from pipeline import preflight
    from pipeline.errors import UserError, user_errors

    flags = [a for a in args if a.startswith("-")]
    if any(f not in HYDRA_RUN_FLAGS for f in flags):
        return None
    overrides = [a for a in args if not a.startswith("-")]
    try:
        preflight.check_run_overrides(overrides)
        jobs = preflight.job_overrides(overrides, multirun=any(f in ("-m", "--multirun") for f in flags))
        for job in jobs or []:
            try:
                _validate_job(job)
            except user_errors() as exc:
                if len(jobs) == 1:
                    raise
                raise UserError(f"sweep job {' '.join(job)}: {_refusal(exc)}") from exc
    except user_errors() as exc:
        print(f"error: {_refusal(exc)}", file=sys.stderr)
        return EXIT_USER
    return None


def _validate_job(overrides: list[str]) -> None:
    """One job's config composed as Hydra composes it (Hydra's compose API, the same conf/ and schema), typed and
    validated as run_pipeline will (pipeline.config.validate_run), without a run folder. A config that reads
    Hydra's runtime (`${hydra:...}`, set only inside the run) is left to the run to validate."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from pipeline.config import register_configs, to_typed, validate_run
    from pipeline.preflight import CONF_DIR

    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides)
    if "${hydra:" not in OmegaConf.to_yaml(cfg):
        validate_run(to_typed(cfg))


def _refusal(exc: BaseException) -> str:
    """A refusal's message: a refused input (InputError) as it says; an OmegaConf or Hydra config error as
    _config_message shows it."""
    from omegaconf.errors import OmegaConfBaseException

    from exporters.errors import InputError

    if isinstance(exc, InputError):
        return str(exc)
    what = "invalid config" if isinstance(exc, OmegaConfBaseException) else "invalid command line or config"
    return f"{what}: {_config_message(exc)}"


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
