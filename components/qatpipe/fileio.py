"""Small file helpers: atomic writes so an interrupted stage never leaves a half-written result."""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from typing import Any


def temp_path(path: Path) -> Path:
    """A sibling temp name unique per process and call, ending in `.part`.

    Several pods or workers may write into one shared folder (the S3 cache) at once; a fixed name would let
    them write into, or rename away, each other's file. The S3 cache leaves `*.part` files alone when pruning.
    """
    return path.with_name(f"{path.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.part")


def atomic_write_text(path: str | Path, text: str) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # a plain open() (not mkstemp, which forces mode 0600) so results stay readable under the usual umask
    tmp = temp_path(path)
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def read_json(path: str | Path, what: str) -> Any:
    """A JSON file's content; a QatpipeError naming the file and what it should hold when it cannot be read."""
    from qatpipe.errors import QatpipeError

    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise QatpipeError(f"{path}: cannot read the {what}: {exc}") from None


def write_json(path: str | Path, data: Any) -> Path:
    return atomic_write_text(path, json.dumps(data, indent=2, sort_keys=False) + "\n")


def save_keras_model(model, path: str | Path) -> Path:
    """Save a tf_keras model atomically; the temp name keeps the suffix Keras uses to pick the format."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.tmp{path.suffix}")
    model.save(tmp)
    os.replace(tmp, path)
    return path
