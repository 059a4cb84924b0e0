"""User-facing errors: raised at the boundary, printed by the CLI as one line, exit code 2."""


class UserError(Exception):
    """Bad input or a missing resource: the message says what was given and what is allowed."""
