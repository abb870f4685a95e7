"""Stage: build an inference engine from an ONNX model (TAO `converter` / `trtexec`), on the backend the spec
or `--backend` names (`auto`: TensorRT with a GPU, else ONNX Runtime)."""

from __future__ import annotations

import logging
from pathlib import Path

from qatpipe.spec import ExperimentSpec
from qatpipe.tracking.records import StageRecord

log = logging.getLogger(__name__)


def build_engine(spec: ExperimentSpec, onnx_path: str | Path, output: str | Path, backend: str | None = None,
                 stage_name: str = "build_engine") -> dict:
    """Build into the folder `output` (engine file + engine.json + tracking.json); returns the metadata."""
    from dataclasses import asdict

    from qatpipe.engines import select_backend
    from qatpipe.export.precision import layer_precision
    from qatpipe.onnx_model import load_onnx_proto

    onnx_path, output = Path(onnx_path), Path(output)
    load_onnx_proto(onnx_path)  # a clear error for a missing or wrong-kind file before any backend starts
    engine = select_backend(backend or spec.engine.backend)
    onnx_path = engine_source(spec, engine.name, onnx_path)
    metadata = engine.build(onnx_path, output, spec.engine)
    metadata.layer_precision = layer_precision(onnx_path)  # what the graph asks each layer to run in
    metadata.write(output)
    size_mb = round((output / metadata.engine_file).stat().st_size / 2**20, 3)
    StageRecord(
        stage=stage_name, params={"engine.backend": metadata.backend, "engine": metadata.label,
                                  "precision": metadata.precision, "runtime_version": metadata.runtime_version,
                                  "device": metadata.device},
        metrics={"engine_size_mb": size_mb, **{f"{kind}_layers": n for kind, n in metadata.layer_precision.items()}},
        artifacts=["engine.json"],
    ).write(output)
    log.info("engine %s: %s (%s; compute layers %s), %.2f MB", output, metadata.label, metadata.precision,
             ", ".join(f"{kind} {n}" for kind, n in metadata.layer_precision.items()), size_mb)
    return {**asdict(metadata), "engine_size_mb": size_mb}


def engine_source(spec: ExperimentSpec, backend: str, onnx_path: Path) -> Path:
    """The ONNX the engine is built from: on TensorRT with a DLA core (Jetson Orin) the export's DLA form when
    it has one (export.target dla); else on TensorRT with `engine.fp16`, the export's FP16 form beside it
    (`<stem>_fp16.onnx`: float regions FP16 through casts, strongly typed, the same on TensorRT 10 and 11) when
    there is one; else `onnx_path`. ONNX Runtime's CPU engines stay float32: CPUs without FP16 arithmetic
    would only emulate it."""
    from qatpipe.engines.tensorrt_backend import dla_cores
    from qatpipe.export.bundle import ExportBundle

    bundle = ExportBundle(onnx_path)
    dla_form = bundle.dla
    if backend == "tensorrt" and dla_form.is_file():
        if dla_cores() > spec.engine.dla_core:
            log.info("engine from the DLA form %s on DLA core %d (export.target dla)", dla_form.name,
                     spec.engine.dla_core)
            return dla_form
        log.info("the export has a DLA form, but no DLA core %d here: building for the GPU; on the Jetson, "
                 "DeepStream builds the DLA engine from the validated model's *_dla nvinfer config",
                 spec.engine.dla_core)
    fp16_form = bundle.fp16
    if backend == "tensorrt" and spec.engine.fp16 and fp16_form.is_file():
        log.info("engine from the FP16 form %s (engine.fp16)", fp16_form.name)
        return fp16_form
    return onnx_path


__all__ = ["build_engine", "engine_source"]
