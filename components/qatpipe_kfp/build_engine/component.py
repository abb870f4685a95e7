"""build-engine: an inference engine from a variant's ONNX (TensorRT with a GPU, else ONNX Runtime), then
its latency benchmark (the same harness for every backend)."""

from kfp.dsl import Input, Metrics, Model, Output

from qatpipe_kfp.settings import component


@component
def build_engine(engine_spec: str, variant: str, onnx_model: Input[Model], engine: Output[Model],
                 metrics: Output[Metrics], gpu_type: str = ""):
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
        info = build_stage(spec, source, engine.path, stage_name=f"build_engine_{variant.replace('-', '_')}")
        report = bench_engine(spec, engine.path)  # bench.json, its figures added to the engine's tracking record
        engine.metadata.update({"backend": info["backend"], "precision": info["precision"], "variant": variant,
                                "device": info["device"], "runtime_version": info["runtime_version"],
                                "source_onnx_file": Path(info["source_onnx"]).name, "gpu_type": gpu_type})
        write_metrics(metrics, figures(report))
