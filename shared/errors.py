"""Eyrie's exception hierarchy.

Every message says what failed, where (file, row, field or YAML path), expected vs got, and
the fix where one is known. Only the CLI turns an `EyrieError` into an exit code.
"""


class EyrieError(Exception):
    """Base class for every error Eyrie raises on purpose."""


class ConfigError(EyrieError):
    """A recipe, override or environment setting is invalid. The CLI exits 2."""


class ArtifactError(EyrieError):
    """An on-disk artifact is missing, malformed or inconsistent with its manifest."""


class ContractMismatchError(EyrieError):
    """Two sides of a convention disagree (trainer vs vLLM, draft vs target, d2t vs t2d)."""


class StageFailedError(EyrieError):
    """A pipeline stage could not complete (too many bad rows, server errors, ...)."""


class InputError(EyrieError):
    """A dataset row or input file is bad; the message names file, row and field. Exit 2."""


class ServiceUnavailableError(EyrieError):
    """A service Eyrie needs (Redis, a vLLM server) cannot be reached."""


class TooManyBadRowsError(StageFailedError, InputError):
    """A stage quarantined more of its input rows than the recipe allows.

    A stage failure (the shard has no manifest) caused by the data, not by Eyrie: the CLI
    exits 2, like any other input error, and a retry without new data fails the same way.
    """
