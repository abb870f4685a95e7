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
    from qatpipe.export.bundle import ExportBundle
    from qatpipe.export.precision import layer_precision
    from qatpipe.onnx_model import load_onnx_proto

    onnx_path, output = Path(onnx_path), Path(output)
    load_onnx_proto(onnx_path)  # a clear error for a missing or wrong-kind file before any backend starts
    engine = select_backend(backend or spec.engine.backend)
    onnx_path = engine.source(ExportBundle(onnx_path), spec.engine)  # the backend's choice of the export's files
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


__all__ = ["build_engine"]
