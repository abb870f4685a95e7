"""Which checkpoint a resume starts from: the newest that reads back whole, past any a crash left corrupt.

A run killed while saving, a full disk or a bad copy can leave the newest checkpoint truncated or garbled, or
the `checkpoint` state file unreadable. Resume must not stop there when an older intact checkpoint is beside
it (train, retrain, the S3 mirror and the MPIJob/TrainJob processes all resume through here).
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

from qatpipe.errors import QatpipeError

log = logging.getLogger(__name__)

CHECKPOINT_DIR = "checkpoints"  # in a training results folder
STATE_FILE = "checkpoint"  # tf.train.CheckpointManager's list of checkpoints
_PREFIX = re.compile(r"^ckpt-(\d+)\.index$")


def checkpoint_prefixes(directory: str | Path) -> list[str]:
    """The checkpoints in `directory`, newest first, found by their files (not the state file, which may be
    the corrupt part)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    numbered = [(int(m.group(1)), directory / f"ckpt-{m.group(1)}")
                for p in directory.iterdir() if (m := _PREFIX.match(p.name))]
    return [str(prefix) for _, prefix in sorted(numbered, reverse=True)]


def read_problem(prefix: str) -> str | None:
    """Why the checkpoint at `prefix` cannot be restored (every tensor is read, so a truncated or garbled
    data file shows), or None when it reads back whole."""
    import tensorflow as tf

    try:
        reader = tf.train.load_checkpoint(prefix)
        for name in reader.get_variable_to_shape_map():
            reader.get_tensor(name)
    except Exception as exc:  # noqa: BLE001 - TF reports a bad file as OpError, IndexError, ValueError...
        return f"{type(exc).__name__}: {_first_line(getattr(exc, 'message', None) or str(exc))}"
    return None


def newest_readable(directory: str | Path, rewrite_state: bool = True) -> str | None:
    """The newest checkpoint in `directory` that reads back whole; None when there is none at all.

    Each unreadable one is named in a warning and skipped (its files are left as they are: the next save of
    that epoch replaces them). With `rewrite_state` (the process that saves, rank 0) the state file is rewritten
    to list only the chosen checkpoint and the older ones, so tf.train.CheckpointManager continues from it.
    Checkpoints that exist but none of which reads: a QatpipeError naming the folder and how to start over.
    """
    directory = Path(directory)
    prefixes = checkpoint_prefixes(directory)
    skipped = []
    for position, prefix in enumerate(prefixes):
        problem = read_problem(prefix)
        if problem is None:
            if rewrite_state and (skipped or _state_problem(directory, prefix)):
                _write_state(directory, prefix, prefixes[position:])
            if skipped:
                log.warning("resuming from %r: the newer checkpoint(s) %s could not be read", Path(prefix).name,
                            ", ".join(repr(Path(p).name) for p in skipped))
            return prefix
        log.warning("checkpoint %r cannot be read, skipped: %s", prefix, problem)
        skipped.append(prefix)
    if prefixes:
        raise QatpipeError(
            f"{directory}: none of its {len(prefixes)} checkpoint(s) can be read (newest: {Path(prefixes[0]).name}). "
            f"To start this training over, move or delete {directory} (and the run's other files beside it)."
        )
    return None


def _state_problem(directory: Path, expected: str) -> bool:
    """True when the state file is missing, unreadable or names another checkpoint as the latest."""
    import tensorflow as tf

    try:
        state = tf.train.get_checkpoint_state(str(directory))
    except (tf.errors.OpError, ValueError):
        return True
    return state is None or Path(state.model_checkpoint_path).name != Path(expected).name


def _write_state(directory: Path, latest: str, kept_newest_first: list[str]) -> None:
    import tensorflow as tf

    (directory / STATE_FILE).unlink(missing_ok=True)  # an unparsable one would make the update fail
    tf.compat.v1.train.update_checkpoint_state(
        str(directory), latest, all_model_checkpoint_paths=list(reversed(kept_newest_first)))


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else "unreadable"
