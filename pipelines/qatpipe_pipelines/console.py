"""What `qatpipe run --local` shows while it runs: kfp.local's task lines and the stages' own log, without the
executor's input JSON and kfp.local's output listings (about nine lines in ten of its output). Every line, shown
or not, goes to the run's log file, so nothing kfp.local printed is lost."""

from __future__ import annotations

import contextlib
import io
import re
import sys
from pathlib import Path
from typing import Iterator, TextIO

# kfp.local's executor lines that say nothing a user acts on (which module it loaded, where it wrote its output)
_EXECUTOR_CHATTER = re.compile(r"\[KFP Executor [^\]]*\]: (Looking for component|Loading KFP component)"
                               r"| INFO root: Wrote executor output file| - INFO - Streamed logs:\s*$")
_INPUT_JSON = "Got executor_input:"  # followed by the task's inputs as indented JSON, up to its closing brace
_OUTPUTS = re.compile(r"Task .* outputs:\s*$")  # followed by each output's value, some over many lines
_KFP_LOCAL_LINE = re.compile(r"^\d\d:\d\d:\d\d\.\d+ - |^-{20,}$")  # kfp.local's own: a time stamp, or its rule


class ConsoleFilter(io.TextIOBase):
    """A text stream for sys.stdout during a local run: every line to `raw`, the lines worth reading to
    `shown`."""

    def __init__(self, shown: TextIO, raw: TextIO):
        self.shown, self.raw = shown, raw
        self._pending = ""
        self._json_end: str | None = None  # the closing brace line of the input JSON being skipped
        self._in_outputs = False

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        self.raw.write(text)
        self._pending += text
        *lines, self._pending = self._pending.split("\n")
        for line in lines:
            if self.keep(line):
                self.shown.write(line + "\n")
        return len(text)

    def flush(self) -> None:
        self.raw.flush()
        self.shown.flush()

    def keep(self, line: str) -> bool:
        """Whether `line` is shown (and the state for the lines after it)."""
        if self._json_end is not None:
            if line.rstrip() == self._json_end:
                self._json_end = None
            return False
        if self._in_outputs:  # a multi-line string output (a spec view's YAML) starts lines at column 0
            if not _KFP_LOCAL_LINE.search(line):
                return False
            self._in_outputs = False
        if _INPUT_JSON in line:
            indent = len(line) - len(line.lstrip())  # kfp.local indents the task's lines; the JSON follows
            self._json_end = " " * indent + "}"
            return False
        if _OUTPUTS.search(line):
            self._in_outputs = True
            return False
        return not _EXECUTOR_CHATTER.search(line) and bool(line.strip())


@contextlib.contextmanager
def filtered_stdout(log_file: Path) -> Iterator[ConsoleFilter]:
    """sys.stdout filtered (ConsoleFilter) for the block; every line appended to `log_file`."""
    with open(log_file, "a", encoding="utf-8") as raw:
        console = ConsoleFilter(sys.stdout, raw)
        with contextlib.redirect_stdout(console):
            try:
                yield console
            finally:
                if console._pending:
                    console.write("\n")
                console.flush()


__all__ = ["ConsoleFilter", "filtered_stdout"]
