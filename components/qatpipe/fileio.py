"""Small file helpers: atomic writes so an interrupted stage never leaves a half-written result, write errors
that name the file, and the lock that keeps two runs out of one results folder."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import sys
import uuid
from pathlib import Path
from typing import Any, Iterator

from qatpipe.errors import QatpipeError, shown

LOCK_FILE = ".qatpipe.lock"


class FolderInUse(QatpipeError):
    """Another process holds the results folder's lock."""


@contextlib.contextmanager
def folder_lock(folder: str | Path) -> Iterator[Path]:
    """Hold `folder` exclusively for the block: a second qatpipe process writing there fails at once, naming the
    folder and the holder's pid. An flock on FOLDER/.qatpipe.lock, which dies with its process, so a killed run
    leaves no stale lock. The file goes when the block ends; when the block fails, so do the folders this call
    made, if they are still empty (nothing already written is ever removed)."""
    folder = Path(folder)
    made = _missing_folders(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd = _locked_file(folder / LOCK_FILE)
    except FolderInUse:
        raise
    except OSError as exc:
        _remove_empty(made)
        raise QatpipeError(f"{folder}: cannot create the results folder's lock: {exc.strerror}") from None
    failed = True
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} ({' '.join(sys.argv[:3])})\n".encode(), 0)
        yield folder
        failed = False
    finally:
        with contextlib.suppress(OSError):  # removed while still held: see _locked_file
            (folder / LOCK_FILE).unlink()
        os.close(fd)  # releases the flock
        if failed:
            _remove_empty(made)


def _locked_file(path: Path) -> int:
    """An open descriptor of `path` holding its flock. A holder removes the file as it lets go, so a lock taken
    on a file no longer at `path` is given up and taken again on the new one."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 512, 0).decode("utf-8", "replace").strip() or "unknown"
            os.close(fd)
            raise FolderInUse(f"{path.parent}: in use by another qatpipe run (pid {holder}); wait for it to finish "
                              f"or write to another folder") from None
        except BaseException:
            os.close(fd)
            raise
        try:
            held, named = os.fstat(fd), os.stat(path)
            if (held.st_dev, held.st_ino) == (named.st_dev, named.st_ino):
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)


def _missing_folders(folder: Path) -> list[Path]:
    """`folder` and those of its parents that do not exist yet, deepest first."""
    missing = []
    for path in (folder, *folder.parents):
        if path.exists():
            break
        missing.append(path)
    return missing


def _remove_empty(folders: list[Path]) -> None:
    for path in folders:  # deepest first; stops at the first that is not empty
        try:
            path.rmdir()
        except OSError:
            return


def write_error(path: str | Path, exc: OSError) -> QatpipeError:
    """An OSError met while writing `path` as one line naming the file (a full disk's ENOSPC carries no path)."""
    return QatpipeError(f"{shown(path)}: cannot write: {_reason(exc)}")


def os_error_line(exc: OSError, folder: str | Path | None = None) -> str:
    """An OSError no writer named, as one line: its file when it has one, else the folder being written."""
    if exc.filename is not None:
        return f"{shown(exc.filename)}: {_reason(exc)}"
    return f"{shown(folder)}: {_reason(exc)} (while writing in this folder)" if folder else _reason(exc)


def _reason(exc: OSError) -> str:
    hint = " (the disk is full)" if exc.errno in (errno.ENOSPC, errno.EDQUOT) else ""
    return f"{exc.strerror or exc}{hint}"


def temp_path(path: Path) -> Path:
    """A sibling temp name unique per process and call, ending in `.part`.

    Several pods or workers may write into one shared folder (the S3 cache) at once; a fixed name would let
    them write into, or rename away, each other's file. The S3 cache leaves `*.part` files alone when pruning.
    """
    return path.with_name(f"{path.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.part")


@contextlib.contextmanager
def replacing(path: str | Path, tmp: Path | None = None) -> Iterator[Path]:
    """Write `path` through a temp name beside it (`temp_path`, or `tmp`): the block writes the yielded name,
    which becomes `path` only when the block succeeds and is removed when not, so a re-run never finds, or
    trusts, a half-written file; an OSError (a full disk) becomes an error naming `path`."""
    path = Path(path)
    tmp = tmp or temp_path(path)
    try:
        yield tmp
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise write_error(path, exc) from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_text(path: str | Path, text: str) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # a plain open() (not mkstemp, which forces mode 0600) so results stay readable under the usual umask
    with replacing(path) as tmp:
        tmp.write_text(text)
    return path


def read_json(path: str | Path, what: str) -> Any:
    """A JSON file's content; a QatpipeError naming the file and what it should hold when it cannot be read."""
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
    with replacing(path, path.with_name(f".{path.stem}.tmp{path.suffix}")) as tmp:
        model.save(tmp)
    return path


def json_sha256(value, length: int = 32) -> str:
    """The first `length` hex digits of the SHA-256 of `value` as canonical JSON (keys sorted): a digest of
    settings and inputs, as build and scoring keys are."""
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:length]


def file_sha256(path: str | Path) -> str:
    """The SHA-256 of a file's bytes, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
