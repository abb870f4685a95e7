"""build-engine: an inference engine from a variant's ONNX (TensorRT with a GPU, else ONNX Runtime), then
its latency benchmark (the same harness for every backend)."""

from typing import Optional

from kfp.dsl import Input, Metrics, Model, Output

from qatpipe_kfp.settings import component


@component
def build_engine(engine_spec: str, variant: str, onnx_model: Input[Model], engine: Output[Model],
                 metrics: Output[Metrics], gpu_type: str = "", same_as: Optional[Input[Model]] = None):
    """Build an inference engine from a variant's ONNX model, then benchmark its latency.

    TensorRT where it imports and a GPU is visible, else ONNX Runtime (`engine.backend` in the spec picks); every
    backend is benchmarked with the same latency harness.

    Args:
        engine_spec: The spec's engine view (sections dataset, model, engine), as YAML.
        variant: The variant's name (fp32, ptq, ptq-partial or qat); names the task's stage and goes into the
            engine's metadata.
        onnx_model: The variant's ONNX model folder; the file is its `file` metadata (default model.onnx).
        gpu_type: The GPU model the engine is built for, as nvidia.com/gpu.product names it; the task fails when the
            node's first GPU is another model or there is none. It keys the KFP cache. Empty: not checked.
        same_as: Another variant's engine folder (ptq-partial's task gets PTQ's): copied with its benchmark,
            instead of building and measuring, when it was built from the same bytes under the same settings for
            this device (a ptq-partial that keeps no layer float is the PTQ model).

    Returns:
        engine: The engine folder: the engine file, engine.json, bench.json and tracking.json; its metadata names
            the backend, precision, variant, device, runtime version, source ONNX file and gpu_type.
        metrics: The engine's size, peak memory, and p50/p99 latency and throughput per benchmarked batch size.
    """
    # gpu_type (a pipeline parameter) keys the cache: an engine is reused only for the GPU model it was built on
    from pathlib import Path

    from qatpipe.devices import check_gpu_type
    from qatpipe.stages.bench_engine import bench_engine, figures
    from qatpipe.stages.build_engine import build_engine as build_stage
    from qatpipe_kfp.runtime import load_stage_spec, stage, write_metrics

    with stage(f"build-engine-{variant}", record=engine):
        check_gpu_type(gpu_type)
        spec = load_stage_spec(engine_spec)
        source = Path(onnx_model.path) / onnx_model.metadata.get("file", "model.onnx")
        same = same_as.path if same_as is not None else None
        info = build_stage(spec, source, engine.path, stage_name=f"build_engine_{variant.replace('-', '_')}",
                           same_as=same)
        report = bench_engine(spec, engine.path, same_as=same)  # bench.json, its figures in the tracking record
        engine.metadata.update({"backend": info["backend"], "precision": info["precision"], "variant": variant,
                                "device": info["device"], "runtime_version": info["runtime_version"],
                                "source_onnx_file": Path(info["source_onnx"]).name, "gpu_type": gpu_type})
        write_metrics(metrics, figures(report))
