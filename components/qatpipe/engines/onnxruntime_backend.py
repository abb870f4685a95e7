"""The portable engine: ONNX Runtime, CPU by default, CUDA / TensorRT execution providers when present.

Building writes the ONNX the runtime executes: for a Q/DQ model, the CPU form `engine.cpu_form` of
graph/cpu_qdq.py (`exact`: the same numbers with uint8 activations; `fast`: BatchNormalization folded and ReLU
absorbed, for integer kernels), so that the CPU provider runs integer kernels where it can; the TensorRT
artifact itself stays symmetric int8. engine.json's `cpu_form` says which form the engine runs.

It builds from the export's ONNX itself, never its FP16 form: CPUs without FP16 arithmetic would only emulate it.
"""

from __future__ import annotations

import logging
import platform
from pathlib import Path

import numpy as np

from qatpipe.engines.base import EngineBackend, EngineMetadata, EngineRunner, engine_label, is_explicitly_quantized
from qatpipe.devices import cpu_name
from qatpipe.fileio import file_sha256

log = logging.getLogger(__name__)

ENGINE_FILE = "model.onnx"


class OnnxRuntimeRunner(EngineRunner):
    def __init__(self, path: Path, metadata: EngineMetadata, threads: int | None = None):
        from qatpipe.onnx_model import ENGINE_PROVIDERS, OnnxModel, available_providers

        self.model = OnnxModel(path, providers=available_providers(ENGINE_PROVIDERS), threads=threads)
        self.providers = self.model.session.get_providers()
        self.metadata = metadata

    def run(self, batch: np.ndarray) -> dict[str, np.ndarray]:
        return self.model.run(batch)


# x86 int8 dot products that add u8 x s8 products in int32 (VNNI, AMX). Without them ONNX Runtime's integer
# convolutions add pairs of products in saturating int16 (vpmaddubsw): measured here on an AMD EPYC without
# AVX512, a QLinearConv over large activations and weights was off by up to 20 int8 steps.
EXACT_INT8_DOT_FLAGS = frozenset({"avx512_vnni", "avx_vnni", "amx_int8"})
X86_MACHINES = ("x86_64", "amd64", "i686", "x86")


def int8_kernels_exact(flags: frozenset[str] | None = None, machine: str | None = None) -> bool:
    """Whether this CPU's integer kernels compute a Q/DQ model's int8 sums without saturating."""
    from qatpipe.devices import cpu_flags

    if (machine or platform.machine()).lower() not in X86_MACHINES:
        return True  # ARM's int8 dot products (sdot/udot) accumulate in int32
    return bool((cpu_flags() if flags is None else flags) & EXACT_INT8_DOT_FLAGS)


def cpu_form_for(setting: str) -> str:
    """The CPU form to build for `engine.cpu_form`: auto is fast only where the integer kernels are exact."""
    exact_kernels = int8_kernels_exact()
    if setting == "auto":
        form = "fast" if exact_kernels else "exact"
        if form == "exact":
            log.warning("engine.cpu_form auto: the exact CPU form, since this CPU has no VNNI or AMX int8 dot "
                        "product and ONNX Runtime's integer kernels would saturate (set fast to build it anyway)")
        return form
    if setting == "fast" and not exact_kernels:
        log.warning("engine.cpu_form fast on a CPU without VNNI or AMX: its integer kernels saturate, so this "
                    "engine's detections can differ from the model's (auto builds the exact form here)")
    return setting


def cpu_int8(form: str, flags: frozenset[str] | None = None, machine: str | None = None) -> dict:
    """How this CPU runs an int8 engine of CPU form `form` (engine.json's cpu_form), for the variant table next
    to the engine's speed-up (bench-engine records it in bench.json): {"form", "dot_products": the CPU's int8
    dot products that sum in int32 (int8_kernels_exact's), "like_tensorrt": whether its speed is that of
    integer kernels summing as TensorRT's do (the fast form on such a CPU), "note": that in words}. The exact
    form fuses few convolutions into integer kernels, and without VNNI/AMX the fast form's sums saturate in
    int16: neither speed is TensorRT's."""
    from qatpipe.devices import cpu_flags

    machine = (machine or platform.machine()).lower()
    flags = cpu_flags() if flags is None else flags
    exact_kernels = int8_kernels_exact(flags, machine)
    # ARM: int8_kernels_exact counts on its sdot/udot
    dot_products = sorted(flags & EXACT_INT8_DOT_FLAGS) if machine in X86_MACHINES else [f"{machine} sdot/udot"]
    like_tensorrt = form == "fast" and exact_kernels
    support = ", ".join(dot_products) if exact_kernels else "no VNNI/AMX"
    if like_tensorrt:
        note = f"fast form on int8 dot products ({support})"
    elif form == "fast":
        note = f"fast form ({support}: int16 sums saturate) - speeds are not TensorRT's"
    else:  # the exact form: few convolutions run as integer kernels, whatever the CPU has
        note = f"{form} form ({f'few integer kernels; {support} unused' if exact_kernels else support}) - speeds " \
               f"are not TensorRT's"
    return {"form": form, "dot_products": dot_products, "like_tensorrt": like_tensorrt, "note": note}


class OnnxRuntimeBackend(EngineBackend):
    name = "onnxruntime"

    @classmethod
    def unavailable_reason(cls) -> str | None:
        return None  # a dependency of qatpipe: always here

    @classmethod
    def device(cls) -> str:
        from qatpipe.onnx_model import ENGINE_PROVIDERS, available_providers

        provider = available_providers(ENGINE_PROVIDERS)[0]
        return cpu_name() if provider == "CPUExecutionProvider" else provider

    def build(self, onnx_path: Path, folder: Path, settings) -> EngineMetadata:
        import onnxruntime as ort

        from qatpipe.graph.cpu_qdq import CPU_FORM_REWRITES, to_cpu_form
        from qatpipe.export.onnx_export import save_onnx
        from qatpipe.onnx_model import ENGINE_PROVIDERS, available_providers, load_onnx_proto

        model = load_onnx_proto(onnx_path)
        providers = available_providers(ENGINE_PROVIDERS)
        on_cpu = providers[0] == "CPUExecutionProvider"
        explicit = is_explicitly_quantized(model)
        # the CPU forms suit the CPU provider; TensorRT / CUDA providers take TensorRT's symmetric int8 as is
        cpu_form = cpu_form_for(settings.cpu_form) if explicit and on_cpu else None
        rewrites = to_cpu_form(model, cpu_form) if cpu_form else dict.fromkeys(CPU_FORM_REWRITES, 0)
        folder.mkdir(parents=True, exist_ok=True)
        save_onnx(model, folder / ENGINE_FILE)
        compute = "int8" if explicit else "fp32"
        precision = (f"int8 (explicit Q/DQ, CPU form {cpu_form})" if cpu_form else
                     "int8 (explicit Q/DQ)" if explicit else "fp32")
        metadata = EngineMetadata(
            backend=self.name, engine_file=ENGINE_FILE, source_onnx=str(onnx_path),
            source_sha256=file_sha256(onnx_path), precision=precision, compute_precision=compute, cpu_form=cpu_form,
            label=engine_label(self.name, "cpu" if on_cpu else providers[0].removesuffix("ExecutionProvider").lower(),
                               compute),
            runtime_version=ort.__version__, device=self.device(),
            input_name=model.graph.input[0].name,
            batch_profile={"min": settings.min_batch, "opt": settings.opt_batch, "max": settings.max_batch},
            extra=rewrites,
        )
        metadata.write(folder)
        log.info("ONNX Runtime engine: %s (%s)", folder / ENGINE_FILE, metadata.precision)
        return metadata

    def load(self, folder: Path, metadata: EngineMetadata) -> EngineRunner:
        return OnnxRuntimeRunner(folder / metadata.engine_file, metadata)
