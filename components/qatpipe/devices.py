"""The machine's NVIDIA GPUs, as the driver reports them (nvidia-smi): what the TensorRT backend records and
checks, and how many Horovod processes `--gpus N` may start."""

from __future__ import annotations

import subprocess


def gpu_names() -> list[str]:
    """Names of the visible GPUs, in device order; empty without a GPU or driver."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in out.splitlines() if line.strip()]
