"""The one error family of pgconvert.

Library code raises these and never prints or exits; the CLI maps them to exit codes:
``ValidationError`` (a request that cannot be honoured: bad layout, bad destination) exits 2,
every other ``PgconvertError`` (a source that is broken, a failed write) exits 1.
"""

from __future__ import annotations


class PgconvertError(ValueError):
    """Base class of every error pgconvert raises on purpose."""

    exit_code: int = 1


class ValidationError(PgconvertError):
    """The request is impossible: detected before any file is written."""

    exit_code = 2


class ConfigError(ValidationError):
    """A model configuration field is missing or violates a constraint.

    ``setting`` names the one ``ModelConfig`` setting it is about and ``constraint`` what that setting
    violates, where the error is about one, so a reader can name the field its user wrote instead.
    """

    def __init__(self, message: str, setting: str | None = None, constraint: str | None = None) -> None:
        super().__init__(message)
        self.setting = setting
        self.constraint = constraint

    def __reduce__(self) -> tuple[type[ConfigError], tuple[str, str | None, str | None]]:
        return type(self), (str(self), self.setting, self.constraint)


class LayoutError(ValidationError):
    """A parallel layout does not fit the model (divisibility, stage sizes)."""


class DestinationError(ValidationError):
    """The destination path cannot be used (exists, inside the source, not writable)."""


class StrictModeError(ValidationError):
    """``--strict`` was given and the conversion would have had to guess."""


class ConversionError(PgconvertError):
    """Writing the destination failed (disk full, I/O error, interrupted)."""


class NotACheckpointError(ValidationError):
    """SRC is not a checkpoint of any known format: a wrong argument, not a broken file."""


class CheckpointError(PgconvertError):
    """A source checkpoint is missing files, corrupt, or inconsistent."""


class IntegrityError(CheckpointError):
    """A file of a checkpoint does not have the digest its integrity manifest records (or is missing)."""


class UnsafePickleError(CheckpointError):
    """A pickle in the source refers to a global outside the allowlist."""


class PluginError(PgconvertError):
    """A loader or saver plugin is unknown or failed to import."""
