"""User-facing errors. Each message names the problem and the fix."""

from __future__ import annotations


class BlockspecError(Exception):
    """Base class: the CLI prints these as one line, without a traceback.

    `cli`: the same message phrased for the command line, where the fix names a flag
    (`--drafter fresh`) instead of a Python argument (`drafter="fresh"`)."""

    def __init__(self, message: str = "", *, cli: str | None = None) -> None:
        super().__init__(message)
        self.cli = cli

    @property
    def cli_message(self) -> str:
        """The message as the command line shows it."""
        return self.cli or str(self)


class ConfigError(BlockspecError, ValueError):
    """An argument or configuration value is invalid."""


class CompatibilityError(BlockspecError, ValueError):
    """A drafter does not fit the target it is paired with."""


class CheckpointError(BlockspecError, OSError):
    """A model directory or checkpoint file is missing or corrupt."""


class ContextLengthError(BlockspecError, ValueError):
    """Prompt plus requested tokens do not fit the model's context."""
