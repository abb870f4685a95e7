"""`qatpipe` command line: TAO-like verbs over the stage functions.

Each module holds one group of commands, its parsers beside its handlers: data, training (train, pretrain,
evaluate, retrain, prune), deploy (export ... validate), run, cluster (compile, submit), compare, spec. A command
checks its files and values (`check`), then holds the folder it writes (`writes`), then works (`func`).
"""

from __future__ import annotations

import logging
import os
import shlex
import sys
import tempfile
import traceback

from qatpipe import __version__  # importing qatpipe sets TF_USE_LEGACY_KERAS before TensorFlow loads
from qatpipe.cli import cluster, compare, data, deploy, run, spec, training
from qatpipe.cli.common import (EXIT_BAD_INPUT, EXIT_CODES, EXIT_INTERNAL, EXIT_INTERRUPTED, Parser, holding,
                                load_spec, log)
from qatpipe.errors import QatpipeError
from qatpipe.logconfig import configure_logging

__all__ = ["build_parser", "main"]


def build_parser() -> Parser:
    parser = Parser(prog="qatpipe", description="TAO-like verbs over the stage functions; `qatpipe VERB --help` "
                    "gives a verb's flags.", epilog=EXIT_CODES)
    parser.add_argument("--version", action="version", version=f"qatpipe {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for group in (data, training, deploy, run, cluster, compare, spec):
        group.add_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    args.argv = argv  # `--gpus N` re-runs this command line under horovodrun
    configure_logging(logging.DEBUG if getattr(args, "verbose", False) else logging.INFO, datefmt="%H:%M:%S")
    try:
        if check := getattr(args, "check", None):  # files and values first: no folder, data or stage yet
            check(args)
        if getattr(args, "experiment_spec", None):
            load_spec(args)
        with holding(args):
            return args.func(args)
    except QatpipeError as exc:
        log.error("%s", exc)
        return EXIT_BAD_INPUT
    except OSError as exc:  # one a writer did not name: its file, else the folder this command writes
        from qatpipe.fileio import os_error_line

        writes = getattr(args, "writes", None)
        log.error("%s", os_error_line(exc, writes(args) if writes else None))
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        log.error("interrupted; re-run the same command to resume from the last checkpoint")
        return EXIT_INTERRUPTED
    except Exception as exc:  # a bug: one line here, the traceback in a file (or here under --debug)
        return _internal_error(exc, argv, getattr(args, "debug", False))


def _internal_error(exc: Exception, argv: list[str], debug: bool) -> int:
    what = f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
    if debug:
        traceback.print_exc()
        log.error("internal error (a bug in qatpipe, not in your input): %s", what)
        return EXIT_INTERNAL
    try:
        fd, path = tempfile.mkstemp(prefix="qatpipe-error-", suffix=".log")
        with os.fdopen(fd, "w") as handle:
            handle.write(f"qatpipe {__version__}: qatpipe {shlex.join(argv)}\n\n")
            traceback.print_exc(file=handle)
        where = f"the traceback is in {path}"
    except OSError as write_failed:
        where = f"the traceback could not be written ({write_failed.strerror})"
    log.error("internal error (a bug in qatpipe, not in your input): %s; %s (--debug prints it here)", what, where)
    return EXIT_INTERNAL
