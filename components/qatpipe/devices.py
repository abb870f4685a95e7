"""The machine's NVIDIA GPUs, as the driver reports them (nvidia-smi): what the TensorRT backend records and
checks, how many Horovod processes `--gpus N` may start, and whether an engine task landed on the GPU model
the pipeline's `gpu_type` names (its cache key)."""

from __future__ import annotations

import re
import subprocess

from qatpipe.errors import QatpipeError


def gpu_names() -> list[str]:
    """Names of the visible GPUs, in device order; empty without a GPU or driver."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in out.splitlines() if line.strip()]


def _model_key(name: str) -> str:
    """"NVIDIA A100-SXM4-80GB" (nvidia-smi) and "NVIDIA-A100-SXM4-80GB" (the nvidia.com/gpu.product label of
    GPU feature discovery) are one model."""
    return re.sub(r"[\s_-]+", "-", name.strip().lower())


def check_gpu_type(expected: str) -> None:
    """Raise QatpipeError when `expected` names a GPU model and this machine's first GPU is another one (or
    there is none): an engine is built for the GPU it runs on, and KFP caches it under `expected`."""
    if not expected.strip():
        return
    names = gpu_names()
    if not names:
        raise QatpipeError(f"gpu_type is {expected!r}, but no NVIDIA GPU is visible here: an engine cached under "
                           f"that name would not be one")
    if _model_key(names[0]) != _model_key(expected):
        raise QatpipeError(f"gpu_type is {expected!r}, but this node's GPU is {names[0]!r}: pin the GPU model "
                           f"with node_selector {{\"nvidia.com/gpu.product\": \"{expected}\"}}, or set gpu_type "
                           f"to the model the engine should be built for")

