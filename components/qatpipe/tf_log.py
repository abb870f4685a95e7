"""TensorFlow's C++ log level, held also while TensorFlow loads.

TF_CPP_MIN_LOG_LEVEL quiets TensorFlow's C++ log once absl's logging is initialised, but the lines written while
`import tensorflow` runs (before absl::InitializeLog) ignore it: "Could not find cuda drivers", oneDNN's and the
CPU feature guard's notices (tensorflow/tensorflow#100442, abseil/abseil-cpp#1957). `quiet_tensorflow_import()`
wraps that one import: stderr (the file descriptor, where the C++ side writes) goes to a temporary file while it
runs, and afterwards every line is written back except absl records below the level and the absl notice that
precedes them. Nothing else is dropped: errors, Python warnings and anything unrecognised come back in order."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import re
import sys
import tempfile

# a record: absl's (severity letter, MMDD, time, thread id, file:line]) or tsl's (date time: severity file:line])
_ABSL_RECORD = re.compile(r"^(?:([IWEF])\d{4} \d\d:\d\d:\d+\.\d+\s+\d+ |"
                          r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+: ([IWEF]) )[^\]]+\] ")
_ABSL_PREINIT = "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR"
_LEVELS = "IWEF"  # TF_CPP_MIN_LOG_LEVEL 0..3 keeps severities from this index on


def min_level() -> int:
    """TF_CPP_MIN_LOG_LEVEL as TensorFlow reads it (0 when unset or not a number)."""
    try:
        return max(0, min(3, int(os.environ.get("TF_CPP_MIN_LOG_LEVEL", "0"))))
    except ValueError:
        return 0


def filter_lines(text: str, level: int) -> str:
    """`text` without the absl records below `level` (and their continuation lines) nor absl's pre-init notice."""
    kept, dropping = [], False
    for line in text.splitlines(keepends=True):
        record = _ABSL_RECORD.match(line)
        if record:
            dropping = _LEVELS.index(record.group(1) or record.group(2)) < level
        elif line.rstrip("\n") == _ABSL_PREINIT:
            dropping = level > 0
        elif not dropping or not line.startswith("To enable the following instructions"):
            dropping = False  # a continuation is only the CPU feature guard's second line
        if not dropping:
            kept.append(line)
    return "".join(kept)


class _QuietLoader(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader, level: int):
        self._loader, self._level = loader, level

    def __getattr__(self, name):  # is_package, get_resource_reader, ...: the real loader's
        return getattr(self._loader, name)

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        module.__spec__.loader = module.__loader__ = self._loader  # what the module and later readers see
        sys.stderr.flush()
        saved = os.dup(2)
        with tempfile.TemporaryFile() as captured:
            os.dup2(captured.fileno(), 2)
            try:
                self._loader.exec_module(module)
            finally:
                sys.stderr.flush()
                os.dup2(saved, 2)
                os.close(saved)
                captured.seek(0)
                sys.stderr.write(filter_lines(captured.read().decode(errors="replace"), self._level))
                sys.stderr.flush()


class _TensorflowFinder(importlib.abc.MetaPathFinder):
    """Finds `tensorflow` as the other finders do, the first time it is imported, and wraps its loader."""

    def find_spec(self, fullname, path, target=None):
        if fullname != "tensorflow":
            return None
        sys.meta_path.remove(self)  # once: the real finders now answer, and answer every later import
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _QuietLoader(spec.loader, min_level())
        return spec


def quiet_tensorflow_import() -> None:
    """Hold TF_CPP_MIN_LOG_LEVEL for the lines TensorFlow prints while it loads (a no-op at level 0, or once
    TensorFlow is loaded)."""
    if min_level() == 0 or "tensorflow" in sys.modules:
        return
    if not any(isinstance(finder, _TensorflowFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _TensorflowFinder())
