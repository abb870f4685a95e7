"""Runs a command with this CPU seen as the AVX2-only machine kind, to estimate that kind's figures on a faster one:

    python bench/avx2_view.py -- make main
    python bench/avx2_view.py -- .venv/bin/pytest

- /proc/cpuinfo, in a mount namespace of the command's own, lists no AVX-512, VNNI or AMX flag: qatpipe chooses by
  those flags its training precision (no bfloat16 under `use_amp: auto`) and ONNX Runtime's CPU form (the exact one).
- ONEDNN_MAX_CPU_ISA=AVX2 keeps oneDNN, which runs TensorFlow's convolutions, to AVX2 kernels.
- ONNX Runtime's and numpy's kernels still choose by the CPUID instruction, and the clock and caches are this
  machine's: an estimate that errs fast (bench/README.md compares it with the AVX2 kind's own figures).
Needs root (unshare -m, mount --bind). Containers the command starts see their own /proc/cpuinfo, the real one.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

from qatpipe.devices import cpu_flags

log = logging.getLogger("bench.avx2_view")

CPUINFO = Path("/proc/cpuinfo")
# the flags the AVX2-only kind lacks: AVX-512 (every subset), the VNNI forms, AMX
HIDDEN = re.compile(r"^(avx512\w*|avx_vnni\w*|amx\w*)$")
# bind-mount the edited file over /proc/cpuinfo (the mount keeps it once its name is gone), then become the command
MOUNT_AND_RUN = 'mount --bind "$0" /proc/cpuinfo && rm -f "$0" && exec "$@"'


def avx2_cpuinfo(text: str) -> str:
    """/proc/cpuinfo's text with the flags lines stripped of HIDDEN flags."""
    def strip(match: re.Match) -> str:
        kept = [flag for flag in match.group(2).split() if not HIDDEN.match(flag)]
        return match.group(1) + " ".join(kept)
    return re.sub(r"^(flags\s*:\s*)(.*)$", strip, text, flags=re.MULTILINE)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command: python bench/avx2_view.py -- COMMAND [ARGS...]")
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        log.error("bench/avx2_view.py: needs root and unshare (util-linux) for its mount namespace")
        return 2
    with tempfile.NamedTemporaryFile("w", prefix="cpuinfo-avx2-", delete=False) as edited:
        edited.write(avx2_cpuinfo(CPUINFO.read_text()))
    hidden = sorted(flag for flag in cpu_flags(CPUINFO) if HIDDEN.match(flag))
    log.info("avx2 view: hiding %s; ONEDNN_MAX_CPU_ISA=AVX2", " ".join(hidden) or "nothing (no such flag here)")
    os.environ["ONEDNN_MAX_CPU_ISA"] = "AVX2"
    os.execvp("unshare", ["unshare", "-m", "--propagation", "private", "sh", "-c", MOUNT_AND_RUN, edited.name,
                          *command])


if __name__ == "__main__":
    sys.exit(main())
