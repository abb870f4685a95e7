"""What the command modules share: exit codes, the parser class, spec arguments, input checks, the folder lock.

Imports of the library sit inside the functions that use them, in this package: `qatpipe --help` and a bad
flag must answer at once, without loading TensorFlow, MLflow or KFP.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
from pathlib import Path

from qatpipe.errors import DataError, QatpipeError

log = logging.getLogger("qatpipe")

# what a script can test for (the --help epilog and the README say the same)
EXIT_OK = 0
EXIT_GATE_FAILED = 1  # the command ran; its model missed the validation gate
EXIT_BAD_INPUT = 2  # a file, spec key, flag or service the user can fix: one line naming it
EXIT_INTERNAL = 3  # a bug: one line, with the traceback in a log file (or on stderr under --debug)
EXIT_INTERRUPTED = 130

EXIT_CODES = ("exit codes: 0 done; 1 the gate failed (validate, run --local); 2 bad input: a file, spec key, flag or "
              "service you can fix, named in one line; 3 an internal error: one line and a log file with the "
              "traceback (--debug prints it instead); 130 interrupted.")


class Parser(argparse.ArgumentParser):
    """An argument parser whose usage errors are one line (exit 2), and whose every command takes the global
    flags -v/--debug before or after its name."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # SUPPRESS: a command's parser leaves the value the top-level parser set alone unless it is given there
        self.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help="debug logging")
        self.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                          help="an internal error prints its traceback here instead of to a log file")

    def error(self, message: str):
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message} (`{self.prog} --help` lists the flags)\n")


def at_least(low: int):
    """An argparse type: a whole number of at least `low` (the error names the flag and the value)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: not a whole number") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{value}: need at least {low}")
        return value

    return parse


def add_spec_args(parser: argparse.ArgumentParser, *aliases: str) -> None:
    parser.add_argument("-e", "--experiment-spec", *aliases, required=True,
                        help="spec YAML file, s3://bucket/key, or a bundled spec name (default, full, tiny)")
    add_overrides(parser)


def add_overrides(parser: argparse.ArgumentParser, help: str = "override a spec key, e.g. --set train.epochs=5 "
                  "(repeatable)") -> None:
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help=help)


def add_model_conversion_args(parser: argparse.ArgumentParser, model_help: str, output_help: str) -> None:
    """-e/--set, then -m MODEL -o OUTPUT: the shape of the commands that turn one model file into another."""
    add_spec_args(parser)
    parser.add_argument("-m", "--model", required=True, type=Path, help=model_help)
    parser.add_argument("-o", "--output", required=True, type=Path, help=output_help)


def load_spec(args):
    """The spec of -e/--set, loaded and checked once (main does it before the folder lock and any work)."""
    if getattr(args, "loaded_spec", None) is None:
        from qatpipe.spec_sources import load_spec_uri

        args.loaded_spec = load_spec_uri(args.experiment_spec, args.overrides)
    return args.loaded_spec


def with_data(args):
    """The spec of -e/--set; a spec naming no data set gets its synthetic one (made once, then cached). Every verb
    that runs a stage resolves it the same way, whether or not it reads images (export's FP16 guard and DLA
    calibration read training images), so `-e default` means the same data set to all of them."""
    from qatpipe.data.prepare import with_default_dataset

    spec = load_spec(args)
    check_folders([(f"dataset.{split}", getattr(spec.dataset, split)) for split in ("train", "val")])
    return with_default_dataset(spec)


def check_folders(entries: list[tuple[str, str | None]], noun: str = "dataset folder") -> None:
    """(spec key, path or URI): a local folder named there that is not there fails before any stage loads
    TensorFlow (an s3:// one is the stage's to fetch and check)."""
    for key, where in entries:
        if where is not None and "://" not in where and not Path(where).is_dir():
            raise DataError(where, f"{key}: {noun} not found")


def check_model(path: Path | None, kind: str, flag: str = "-m") -> None:
    """A model input of `kind` (keras, onnx, engine, or any of them) is there and of that kind: checked before
    any data is made or any stage starts. The error names the flag and the file."""
    if path is None:
        return
    try:
        if kind == "any":  # evaluate's: by what the path is
            from qatpipe.models.io import KERAS_SUFFIXES

            kind = "engine" if path.is_dir() else "onnx" if path.suffix.lower() == ".onnx" else "keras"
            if path.exists() and kind == "keras" and path.suffix.lower() not in KERAS_SUFFIXES:
                raise QatpipeError(f"{path}: not a model (a {', '.join(KERAS_SUFFIXES)} or .onnx file, or an engine "
                                   f"folder)")
        if kind == "keras":
            from qatpipe.models.io import check_keras_file

            check_keras_file(path)
        elif kind == "onnx":
            from qatpipe.onnx_model import check_onnx_file

            check_onnx_file(path)
        else:
            from qatpipe.engines.base import EngineMetadata

            EngineMetadata.read(path)
    except QatpipeError as exc:
        raise QatpipeError(f"{flag} {exc}") from None


def check_file(path: Path | None, flag: str, what: str) -> None:
    if path is not None and not path.is_file():
        raise QatpipeError(f"{flag} {path}: {what} not found")


def holding(args):
    """The lock on the folder this command writes (`writes` of its parser; `run` locks its own in run_local):
    two commands writing one results folder at once would clobber each other. A process that horovodrun or
    mpirun started is one of N: its launcher holds the lock."""
    from qatpipe.fileio import folder_lock
    from qatpipe.training.distributed import launched_by_horovod

    writes = getattr(args, "writes", None)
    if writes is None or launched_by_horovod():
        return contextlib.nullcontext()
    return folder_lock(writes(args))
