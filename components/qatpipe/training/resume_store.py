"""Durable resume state on S3, for training tasks without the cache volume (the pipeline's `checkpoint_uri`).

A pre-empted training pod loses its local disk; KFP retries the task in a new pod. With the cache volume the
work folder lives there (stages/scale_out.py). Without it, `run_training_stage` works in a temporary folder and
mirrors the folder's resume state to `<checkpoint_uri>/<KFP run id>/<job folder>` on S3: `restore` before the
training, `ResumeStateUpload` after every checkpoint (the training's chief process), `clear` once the model is
kept. The retry restores the mirror and resumes at the next epoch.

What is uploaded: every file of the work folder but TensorBoard's (they go to their own artifact), the
checkpoint state files (`checkpoint`, naming the latest) last, so a pod killed mid-upload leaves the previous
state whole; objects of checkpoints the manager has since deleted are removed after.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from qatpipe.errors import StorageError

log = logging.getLogger(__name__)

RESUME_URI_ENV = "QATPIPE_RESUME_URI"  # the mirror's URI, for the training processes (Horovod's too)
STATE_FILE = "checkpoint"  # TensorFlow's CheckpointManager state: names the latest checkpoint
SKIPPED = ("tensorboard",)


def _keys(uri: str, client) -> list[str]:
    from qatpipe.storage import list_objects

    return [obj["Key"] for obj in list_objects(uri, client, must_exist=False)]


def _files(folder: Path) -> list[str]:
    files = [p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()]
    kept = [rel for rel in files if rel.split("/")[0] not in SKIPPED and not rel.endswith(".part")]
    return sorted(kept, key=lambda rel: (Path(rel).name == STATE_FILE, rel))  # state files last


def save(folder: str | Path, uri: str, *, client=None) -> int:
    """Mirror `folder`'s resume state to `uri` (see the module docstring); returns the files uploaded."""
    from qatpipe.storage import parse_s3_uri, s3_client, s3_errors

    folder = Path(folder)
    bucket, prefix = parse_s3_uri(uri)
    client = client or s3_client()
    files = _files(folder)
    with s3_errors(uri, client):
        for rel in files:
            client.upload_file(str(folder / rel), bucket, f"{prefix}/{rel}")
    kept = set(files)
    stale = [key for key in _keys(uri, client) if key[len(prefix) + 1:] not in kept]
    with s3_errors(uri, client):
        for key in stale:
            client.delete_object(Bucket=bucket, Key=key)
    log.info("resume state: %d files mirrored to %s", len(files), uri)
    return len(files)


def restore(uri: str, folder: str | Path, *, client=None) -> int:
    """Download the mirror at `uri` into `folder`; returns the files restored (0: nothing there yet)."""
    from qatpipe.storage import parse_s3_uri, s3_client, s3_errors

    bucket, prefix = parse_s3_uri(uri)
    client = client or s3_client()
    folder = Path(folder)
    keys = _keys(uri, client)
    with s3_errors(uri, client):
        for key in keys:
            target = folder / key[len(prefix) + 1:]
            target.parent.mkdir(parents=True, exist_ok=True)
            client.download_file(bucket, key, str(target))
    if keys:
        log.info("resume state: %d files restored from %s", len(keys), uri)
    return len(keys)


def clear(uri: str, *, client=None) -> None:
    """Delete the mirror (the training finished and its model is kept)."""
    from qatpipe.storage import parse_s3_uri, s3_client, s3_errors

    bucket, _ = parse_s3_uri(uri)
    client = client or s3_client()
    keys = _keys(uri, client)
    with s3_errors(uri, client):
        for key in keys:
            client.delete_object(Bucket=bucket, Key=key)


def mirror_uri() -> str | None:
    """The mirror the training processes upload to, when run_training_stage set one."""
    return os.environ.get(RESUME_URI_ENV) or None


def upload_callback(folder: Path, manager):
    """A Keras callback that mirrors `folder` after each new checkpoint of `manager` (the chief process's
    callbacks, after the checkpoint callback); None without a mirror."""
    import tf_keras as keras

    uri = mirror_uri()
    if uri is None:
        return None

    class ResumeStateUpload(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.uploaded = manager.latest_checkpoint

        def on_epoch_end(self, epoch, logs=None):
            if manager.latest_checkpoint != self.uploaded:
                try:
                    save(folder, uri)
                except StorageError as exc:  # training goes on; a retry would resume from an older state
                    log.warning("resume state not mirrored after epoch %d: %s", epoch + 1, exc)
                    return
                self.uploaded = manager.latest_checkpoint

    return ResumeStateUpload()


__all__ = ["RESUME_URI_ENV", "clear", "mirror_uri", "restore", "save", "upload_callback"]
