"""The machine's NVIDIA GPUs, as the driver reports them (nvidia-smi): what the TensorRT backend records and
checks, how many Horovod processes `--gpus N` may start, and whether an engine task landed on the GPU model
the pipeline's `gpu_type` names (its cache key); and the CPU's name and feature flags."""

from __future__ import annotations

import platform
import re
import subprocess
from pathlib import Path

from qatpipe.errors import QatpipeError

_CPUINFO = Path("/proc/cpuinfo")


def cpu_flags(cpuinfo: Path = _CPUINFO) -> frozenset[str]:
    """The CPU feature flags the kernel reports (empty where /proc/cpuinfo does not exist, e.g. macOS): what
    the CPU's mixed precision and the ONNX Runtime CPU form are chosen by."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def cpu_name(cpuinfo: Path = _CPUINFO) -> str:
    """The CPU's model name as the kernel reports it, else what the platform module knows."""
    try:
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


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


GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"  # the GPU model label GPU Feature Discovery puts on nodes


def gpu_node_selector(node_selector: dict, gpu_type: str) -> dict:
    """The GPU stages' node selector: `node_selector` plus GPU_PRODUCT_LABEL = `gpu_type` when one is named,
    so that the GPU model engines are cached under is the one they are built on. A `node_selector` that pins
    another model is refused, naming both."""
    selector = {str(key): str(value) for key, value in (node_selector or {}).items()}
    gpu_type = (gpu_type or "").strip()
    if not gpu_type:
        return selector
    pinned = selector.get(GPU_PRODUCT_LABEL)
    if pinned is not None and pinned != gpu_type:
        raise QatpipeError(f"node_selector pins {GPU_PRODUCT_LABEL}={pinned!r} but gpu_type is {gpu_type!r}: "
                           f"name one GPU model")
    return {**selector, GPU_PRODUCT_LABEL: gpu_type}


def training_task_holds_gpus(workers: int) -> bool:
    """Whether a train / retrain task trains in its own pod (one node) and so needs the GPUs; with workers > 1
    it only creates and follows an MPIJob or TrainJob, whose pods hold them (stages/scale_out.py)."""
    if workers < 1:
        raise QatpipeError(f"workers is {workers}: at least one node trains")
    return workers == 1


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

