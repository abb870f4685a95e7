"""validate: mAP of a variant's engine on the val set against the FP32 baseline, the gate
(`validate.max_map_drop`), and for a passing model the DeepStream nvinfer config."""

from kfp.dsl import Artifact, Dataset, Input, Markdown, Metrics, Model, Output

from qatpipe_kfp.settings import component


@component
def validate(validate_spec: str, variant: str, dataset: Input[Dataset], engine: Input[Model],
             onnx_model: Input[Model], baseline: Input[Artifact], results: Output[Artifact],
             metrics: Output[Metrics], report: Output[Markdown]) -> bool:
    """Returns whether the variant passed the gate (a single output: kfp.local's dsl.If resolves only those)."""
    import json
    from pathlib import Path

    from qatpipe.data.prepare import spec_with_prepared_dataset
    from qatpipe.deploy.deepstream import write_nvinfer_config
    from qatpipe.stages.bench_engine import BENCH_FILE
    from qatpipe.stages.evaluate import METRICS_FILE
    from qatpipe.stages.validate import MARKDOWN_FILE, gate_message, validate as validate_stage
    from qatpipe_kfp.runtime import load_stage_spec, stage, write_metrics, write_text

    with stage(f"validate-{variant}"):
        spec = spec_with_prepared_dataset(load_stage_spec(validate_spec), dataset.path)
        bench_path = Path(engine.path) / BENCH_FILE
        bench = json.loads(bench_path.read_text()) if bench_path.is_file() else None
        onnx_file = Path(onnx_model.path) / onnx_model.metadata.get("file", "model.onnx")
        result = validate_stage(spec, engine.path, Path(baseline.path) / METRICS_FILE, results.path, variant, bench,
                                onnx_model=onnx_file)
        if bench:
            (Path(results.path) / BENCH_FILE).write_text(json.dumps(bench, indent=2) + "\n")
        if result["passed"]:
            # nvinfer's network-mode from what the engine is, not from the variant's name
            write_nvinfer_config(spec, onnx_file, Path(results.path) / "deepstream", variant,
                                 "int8" if result["engine_label"].endswith("int8") else "fp16")
        else:
            from qatpipe_kfp.runtime import log

            log.warning("%s", gate_message(result))
        results.metadata.update({"variant": variant, "passed": result["passed"], "engine": result["engine_label"]})
        write_metrics(metrics, {key: float(result[key]) for key in
                                ("map50", "map", "map50_drop", "map50_tensorrt_emulated", "passed") if key in result})
        write_text(report, (Path(results.path) / MARKDOWN_FILE).read_text())
        return bool(result["passed"])
