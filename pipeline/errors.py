"""The errors the command line reports as one line on stderr, and its exit codes.

Exit codes of `python -m pipeline <run|check|show>`:
    EXIT_OK            0  done (`check`: the runtime check passed)
    EXIT_CHECK_FAILED  1  the runtime check failed: the kernel disagrees with the oracle or could not run
                          (`check`, and `run` through RuntimeCheckError); the manifest records the outcome
    EXIT_USER          2  bad input refused before or while running (UserError, an invalid config or option,
                          an artifact the strict loader refuses, a bad command line)
    EXIT_UNREACHABLE   3  the MLflow tracking store could not be reached; the results are still written
    EXIT_GATE          4  the artifact crossed a drift-gate threshold (GateError); the results are still written
"""
from __future__ import annotations

EXIT_OK = 0
EXIT_CHECK_FAILED = 1
EXIT_USER = 2
EXIT_UNREACHABLE = 3
EXIT_GATE = 4


class UserError(Exception):
    """Bad input or a missing resource: the message says what was given and what is allowed (EXIT_USER)."""


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


__all__ = ["EXIT_OK", "EXIT_CHECK_FAILED", "EXIT_USER", "EXIT_UNREACHABLE", "EXIT_GATE", "UserError", "GateError",
           "RuntimeCheckError"]
