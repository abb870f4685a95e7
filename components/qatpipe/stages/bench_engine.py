"""Stage: latency and size of an engine: the same harness for every backend (engines/latency.py)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np

from qatpipe.errors import QatpipeError
from qatpipe.fileio import write_json
from qatpipe.spec import ExperimentSpec
from qatpipe.tracking.records import RECORD_FILE, StageRecord

log = logging.getLogger(__name__)

BENCH_FILE = "bench.json"


def bench_engine(spec: ExperimentSpec, engine_dir: str | Path, output: str | Path | None = None,
                 same_as: str | Path | None = None) -> dict:
    """p50/p95/p99 latency and throughput at each `engine.bench.batch_sizes`, model and engine size, peak
    memory, and for an int8 engine on the CPU how this CPU runs it (`cpu_int8`, onnxruntime_backend.cpu_int8);
    written to `output` (default ENGINE_DIR/bench.json, and then its figures join the engine's tracking record).
    `same_as`: another engine folder whose benchmark is taken when it is this engine (the same build_key and
    device: build_engine copied it) measured under the same engine.bench settings."""
    from qatpipe.engines.base import EngineMetadata

    engine_dir = Path(engine_dir)
    metadata = EngineMetadata.read(engine_dir)
    settings = spec.engine.bench
    report = _measured_by(Path(same_as), metadata, settings.model_dump(mode="json")) if same_as else None
    if report is None:
        report = _measure(spec, engine_dir)
    report["engine"] = str(engine_dir)
    write_json(Path(output) if output else engine_dir / BENCH_FILE, report)
    if output is None and (engine_dir / RECORD_FILE).is_file():
        record = StageRecord.read(engine_dir)
        record.metrics.update(figures(report))
        record.artifacts.append(BENCH_FILE)
        record.write(engine_dir)
    return report


def _measured_by(folder: Path, metadata, settings: dict) -> dict | None:
    """The benchmark of the engine in `folder` when it is this engine (`metadata`'s build_key and device)
    measured under `settings`; None, saying why, when it is not."""
    from qatpipe.engines.base import EngineMetadata

    try:
        theirs = EngineMetadata.read(folder)
        report = json.loads((folder / BENCH_FILE).read_text())
    except (QatpipeError, OSError, ValueError) as exc:
        log.info("measuring the engine: %s has no benchmark to take (%s)", folder, exc)
        return None
    if not metadata.build_key or (theirs.build_key, theirs.device) != (metadata.build_key, metadata.device) \
            or report.get("settings") != settings:
        log.info("measuring the engine: %s is another engine, or was measured under other settings", folder)
        return None
    log.info("the same engine as %s, measured under the same settings: its benchmark taken", folder)
    return {**report, "measured_as": str(folder)}


def _measure(spec: ExperimentSpec, engine_dir: Path) -> dict:
    """The benchmark itself: the engine run on random batches of each engine.bench.batch_sizes."""
    from qatpipe.engines import load_engine
    from qatpipe.engines.latency import measure_latency, peak_rss_mb
    from qatpipe.engines.onnxruntime_backend import cpu_int8

    runner = load_engine(engine_dir)
    metadata = runner.metadata
    size = spec.dataset.image_size
    settings = spec.engine.bench
    rng = np.random.default_rng(0)
    results = []
    for batch_size in settings.batch_sizes:
        batch = rng.uniform(size=(batch_size, size.height, size.width, 3)).astype(np.float32)
        result = measure_latency(runner.run, batch, settings.warmup, settings.iterations, settings.min_seconds)
        log.info("%s batch %d: p50 %.2f ms, p99 %.2f ms, %.1f img/s", engine_dir, batch_size,
                 result.latency_ms_p50, result.latency_ms_p99, result.throughput)
        results.append(result.to_dict())
    source = Path(metadata.source_onnx)
    report = {
        "engine": str(engine_dir), "label": metadata.label, "backend": metadata.backend,
        "precision": metadata.precision, "device": metadata.device, "runtime_version": metadata.runtime_version,
        "model_size_mb": round(source.stat().st_size / 2**20, 3) if source.is_file() else None,
        "engine_size_mb": round((engine_dir / metadata.engine_file).stat().st_size / 2**20, 3),
        "peak_memory_mb": peak_rss_mb(), "batches": results, "settings": settings.model_dump(mode="json"),
    }
    on_cpu = getattr(runner, "providers", [None])[0] == "CPUExecutionProvider"
    if metadata.cpu_form and on_cpu:  # an int8 engine on this CPU: how its kernels sum says what its speed means
        report["cpu_int8"] = cpu_int8(metadata.cpu_form)
    return report


def figures(report: dict) -> dict[str, float]:
    """The benchmark's numbers worth a metric: sizes, peak memory, and latency/throughput per batch size."""
    values = {"engine_size_mb": report["engine_size_mb"], "peak_memory_mb": report["peak_memory_mb"]}
    for row in report["batches"]:
        for key in ("latency_ms_p50", "latency_ms_p99", "throughput"):
            values[f"batch{row['batch_size']}.{key}"] = row[key]
    return values


__all__ = ["bench_engine", "figures", "BENCH_FILE"]
