"""The errors the command line reports as one line on stderr, and its exit codes.

Exit codes of `python -m pipeline <run|check|show>`, the same for every subcommand (README.md "Exit codes" holds
this table verbatim; tests/pipeline/test_cli.py checks that the two agree and match the constants below):

| code | name | meaning |
|---|---|---|
| 0 | `EXIT_OK` | done (`check`: the runtime check passed) |
| 1 | `EXIT_CHECK_FAILED` | the runtime check failed: kernel and oracle disagree, the kernel could not run, or the quality canary failed |
| 2 | `EXIT_USER` | bad input refused: config, option, recipe, model, data, artifact or command line |
| 3 | `EXIT_UNREACHABLE` | the MLflow tracking store could not be reached; the results are still written |
| 4 | `EXIT_GATE` | the artifact crossed a drift-gate threshold; the results are still written |
| 5 | `EXIT_INTERNAL` | an unexpected error (a bug, not bad input); the traceback is printed |
| 130 | `EXIT_INTERRUPTED` | interrupted (Ctrl-C, SIGINT): one line says what is kept and the command that takes it up again (`run` resumes from its finished stages) |

Which exception gives which code: RuntimeCheckError -> 1 (the manifest records the failed check); `user_errors()`
-> 2 (exporters.errors.InputError, the one base of UserError, the stages' errors, exporters' CodecError and
ManifestError; OmegaConf and Hydra config errors); TrackingError -> 3; GateError -> 4; anything else -> 5;
KeyboardInterrupt (Ctrl-C) -> 130, the shell's code for a process SIGINT ended (128 + 2), caught in pipeline/cli.py
main for every subcommand.
"""
from __future__ import annotations

import errno
import os
from pathlib import Path

from exporters.errors import InputError

EXIT_OK = 0
EXIT_CHECK_FAILED = 1
EXIT_USER = 2
EXIT_UNREACHABLE = 3
EXIT_GATE = 4
EXIT_INTERNAL = 5
EXIT_INTERRUPTED = 130   # 128 + SIGINT: what a shell reports for a command Ctrl-C stopped


class UserError(InputError):
    """Bad input or a missing resource: the message says what was given and what is allowed (EXIT_USER). The
    pipeline's kind of stages.base.InputError, which the stages raise for the same reason."""


def user_errors() -> tuple[type[BaseException], ...]:
    """The exception types that are deliberate refusals of bad input (EXIT_USER): exporters.errors.InputError,
    the one base of every refusal (UserError, the stages' errors, the codec's CodecError, the manifest's
    ManifestError), and OmegaConf's and Hydra's config errors (imported when needed: they bring their weight)."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    return (InputError, OmegaConfBaseException, HydraException)


MAX_REFUSAL_CHARS = 2000   # a refusal quoting an artifact's value (a megabyte string, a deep list) is cut here


def refusal_text(exc: BaseException, limit: int = MAX_REFUSAL_CHARS) -> str:
    """A refusal's message for the terminal: what it quotes from untrusted input may hold control characters,
    terminal escapes or megabytes, so every unprintable character but a newline is escaped and the message is cut
    to `limit` characters, the rest counted."""
    text = str(exc)
    out = "".join(c if c.isprintable() or c == "\n" else repr(c)[1:-1] for c in text[:limit])
    return out if len(text) <= limit else f"{out}... ({len(text)} characters)"


MAX_SHOWN_CHARS = 200   # one string of an artifact (a recipe or model name, a path) as printed


def shown(value, limit: int = MAX_SHOWN_CHARS) -> str:
    """One string from untrusted input (an artifact's recipe or model name, a path it records) as it may be printed
    on a line of its own: every unprintable character -- newline, ESC and the other terminal controls -- written as
    its Python escape (\\x1b, \\n), cut to `limit` characters with the rest counted."""
    text = str(value)
    out = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text[:limit])
    return out if len(text) <= limit else f"{out}... ({len(text)} characters)"


def _limit(name: str, default: int) -> int:
    try:
        return os.pathconf("/", name)
    except (OSError, ValueError, AttributeError):
        return default


PATH_MAX = _limit("PC_PATH_MAX", 4096)   # bytes of a path the system looks up (Linux: 4096, the final NUL included)
NAME_MAX = _limit("PC_NAME_MAX", 255)    # bytes of one component


def path_argument(value: str, what: str) -> Path:
    """A path given on the command line (`what` names it as the usage does: ARTIFACT, OUT, RUN_DIR, model.path,
    --out) -> Path, once the system can look it up. Refused (UserError: `what`, the value as shown() prints it and
    the system's reason) when it cannot be looked up at all: longer than PATH_MAX or with a component longer than
    NAME_MAX (ENAMETOOLONG), a NUL character, a loop of symbolic links, a folder on the way that cannot be searched.
    Without this, the command's first os.stat / Path.is_dir raises OSError, which says "a bug" (EXIT_INTERNAL)
    where the input was wrong. A path that merely does not exist passes: each command says what it expected there."""
    try:
        os.stat(value)
    except (FileNotFoundError, NotADirectoryError):
        pass
    except UnicodeEncodeError:   # a lone surrogate no file name encodes (argv never holds one: surrogateescape)
        raise UserError(f"{what}: {shown(value)} is no file name this system encodes; allowed a path") from None
    except ValueError:   # a NUL character (os.stat refuses it before the system sees it)
        raise UserError(f"{what}: {shown(value)} holds a NUL character; allowed a path") from None
    except OSError as exc:
        why = exc.strerror or type(exc).__name__
        if exc.errno == errno.ENAMETOOLONG:
            longest = max(len(os.fsencode(part)) for part in value.split(os.sep))
            why += (f": {len(os.fsencode(value))} bytes, the longest component {longest}; this system looks up at "
                    f"most {PATH_MAX - 1} bytes, {NAME_MAX} per component")
        raise UserError(f"{what}: {shown(value)}: {why}") from None
    return Path(value)


class GateError(RuntimeError):
    """The artifact crossed a drift-gate threshold; the message names the offending cells (EXIT_GATE). `out`
    carries the run's results (written before the gate failed) so they can still be recorded."""

    def __init__(self, message: str, out: dict | None = None):
        super().__init__(message)
        self.out = out


class RuntimeCheckError(Exception):
    """The kernel disagrees with the oracle beyond the tolerance, or could not run; the manifest records it
    (EXIT_CHECK_FAILED). `result` is the runtime_check record."""

    def __init__(self, artifact_dir, result: dict):
        cause = result.get("error") or (f"max_rel_err {result['max_rel_err']:.3e} beyond rtol "
                                        f"{result['tolerance']['rtol']:g} (max_abs_err {result['max_abs_err']:.3e})")
        super().__init__(f"runtime check failed for {artifact_dir}: {cause}; see runtime_check in its manifest.json")
        self.result = result


__all__ = ["EXIT_OK", "EXIT_CHECK_FAILED", "EXIT_USER", "EXIT_UNREACHABLE", "EXIT_GATE", "EXIT_INTERNAL",
           "EXIT_INTERRUPTED", "UserError", "InputError", "user_errors", "refusal_text", "shown", "MAX_SHOWN_CHARS",
           "path_argument", "PATH_MAX", "NAME_MAX", "GateError", "RuntimeCheckError"]
