"""Errors that carry a message for the user rather than a traceback.

The CLI turns a `UserError` into one line on stderr and exit code 2 (docs/design.md contract).
"""


class UserError(Exception):
    """Bad input from the user: a config field, a file, a flag. The message names it and the fix."""


class ConfigError(UserError, ValueError):
    """The config (YAML file or an override) is invalid."""


class DataError(UserError):
    """A data file or directory is missing, empty or malformed."""


class CheckpointError(UserError):
    """A checkpoint cannot be read or does not belong to this run."""


class TrainingError(Exception):
    """The run itself failed (e.g. diverged to non-finite values): one line, exit code 1, status failed."""


def one_line(exc: BaseException) -> str:
    """`Type: message` on one line, for quoting an exception from someone else's code in a UserError."""
    return f"{type(exc).__name__}: {' '.join(str(exc).split())}"
