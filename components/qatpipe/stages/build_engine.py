"""Stage: build an inference engine from an ONNX model (TAO `converter` / `trtexec`), on the backend the spec
or `--backend` names (`auto`: TensorRT with a GPU, else ONNX Runtime)."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from qatpipe.errors import QatpipeError
from qatpipe.spec import ExperimentSpec
from qatpipe.stages.bench_engine import BENCH_FILE
from qatpipe.tracking.records import RECORD_FILE, StageRecord

log = logging.getLogger(__name__)


def build_engine(spec: ExperimentSpec, onnx_path: str | Path, output: str | Path, backend: str | None = None,
                 stage_name: str = "build_engine", same_as: str | Path | None = None) -> dict:
    """Build into the folder `output` (engine file + engine.json + tracking.json); returns the metadata.
    `same_as`: another engine folder, copied instead of building when it was built by this backend for this
    device from the same bytes under the same engine settings (its build_key and device are this build's)."""
    from dataclasses import asdict

    from qatpipe.engines import select_backend
    from qatpipe.export.bundle import ExportBundle
    from qatpipe.export.precision import layer_precision
    from qatpipe.onnx_model import load_onnx_proto

    onnx_path, output = Path(onnx_path), Path(output)
    load_onnx_proto(onnx_path)  # a clear error for a missing or wrong-kind file before any backend starts
    engine = select_backend(backend or spec.engine.backend)
    onnx_path = engine.source(ExportBundle(onnx_path), spec.engine)  # the backend's choice of the export's files
    key = build_key(engine.name, onnx_path, spec)
    metadata = _copied(Path(same_as), output, key, engine.device()) if same_as else None
    copied = {"copied_from": str(same_as)} if metadata else {}
    if metadata is None:
        metadata = engine.build(onnx_path, output, spec.engine)
        metadata.layer_precision = layer_precision(onnx_path)  # what the graph asks each layer to run in
    metadata.source_onnx, metadata.build_key = str(onnx_path), key
    metadata.write(output)
    size_mb = round((output / metadata.engine_file).stat().st_size / 2**20, 3)
    StageRecord(
        stage=stage_name, params={"engine.backend": metadata.backend, "engine": metadata.label,
                                  "precision": metadata.precision, "runtime_version": metadata.runtime_version,
                                  "device": metadata.device, **copied},
        metrics={"engine_size_mb": size_mb, **{f"{kind}_layers": n for kind, n in metadata.layer_precision.items()}},
        artifacts=["engine.json"],
    ).write(output)
    log.info("engine %s: %s (%s; compute layers %s), %.2f MB", output, metadata.label, metadata.precision,
             ", ".join(f"{kind} {n}" for kind, n in metadata.layer_precision.items()), size_mb)
    return {**asdict(metadata), "engine_size_mb": size_mb}


def build_key(backend: str, onnx_path: Path, spec: ExperimentSpec) -> str:
    """What an engine is built from, as a digest: the backend, the source's bytes and the engine settings (its
    latency benchmark's aside)."""
    from qatpipe.fileio import file_sha256, json_sha256

    settings = spec.engine.model_dump(mode="json", exclude={"bench"})
    return json_sha256({"backend": backend, "source_sha256": file_sha256(onnx_path), "engine": settings,
                        "image_size": spec.dataset.image_size.model_dump()})


def _copied(folder: Path, output: Path, key: str, device: str):
    """The engine in `folder` copied into `output` (not its tracking record or benchmark), and its metadata,
    when it was built under `key` for `device`; None, saying why, when it was not."""
    from qatpipe.engines.base import EngineMetadata

    try:
        metadata = EngineMetadata.read(folder)
    except QatpipeError as exc:
        log.info("building the engine: %s", exc)
        return None
    if metadata.build_key != key or metadata.device != device:
        log.info("building the engine: %s was built from other bytes, settings or for another device", folder)
        return None
    output.mkdir(parents=True, exist_ok=True)
    for path in folder.iterdir():
        if path.is_file() and path.name not in (RECORD_FILE, BENCH_FILE):
            shutil.copyfile(path, output / path.name)
    log.info("the same source, settings and device as %s: its engine copied, not built again", folder)
    return metadata


__all__ = ["build_engine", "build_key"]
