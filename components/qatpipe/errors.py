"""Error types that reach the user as one clear line (the CLI prints them without a traceback)."""

from __future__ import annotations

from pathlib import Path


def shown(text: str | Path) -> str:
    """A path or name as it may go into a log line: escaped repr-style when it holds a newline or another
    control character, so a file name cannot forge a log line."""
    text = str(text)
    return text if text.isprintable() else repr(text)[1:-1]


class QatpipeError(Exception):
    """Base class: a problem the user can fix (bad input, bad spec, unreachable service)."""


class SpecError(QatpipeError):
    """The experiment spec is invalid: names the key path."""


class DataError(QatpipeError):
    """A dataset file is missing or malformed: names the file and, for label files, the line."""

    def __init__(self, path: str | Path, message: str, line: int | None = None):
        self.path = str(path)
        self.line = line
        self.reason = message
        where = f"{shown(self.path)}:{line}" if line is not None else shown(self.path)
        super().__init__(f"{where}: {message}")


class StorageError(QatpipeError):
    """Remote storage (S3) could not be read: names the URI and endpoint."""


class ModelFileError(QatpipeError):
    """A model file is missing, corrupt or of the wrong kind."""


class TrackingError(QatpipeError):
    """The MLflow tracking server could not be reached or refused a write: names the URI."""
