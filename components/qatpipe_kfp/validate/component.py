"""validate: mAP of a variant's engine on the val set against the FP32 baseline, the gate
(`validate.max_map_drop`), and for a passing model the DeepStream nvinfer config."""

from typing import Optional

from kfp.dsl import Artifact, Dataset, Input, Markdown, Metrics, Model, Output

from qatpipe_kfp.settings import component


@component
def validate(validate_spec: str, variant: str, dataset: Input[Dataset], engine: Input[Model],
             onnx_model: Input[Model], baseline: Input[Artifact], results: Output[Artifact],
             metrics: Output[Metrics], report: Output[Markdown], same_as: Optional[Input[Artifact]] = None) -> bool:
    """Validate a variant's engine on the val set against the FP32 baseline and apply the gate.

    The gate passes when the engine's mAP@0.5, and TensorRT's emulated mAP@0.5 where it is scored, are at most
    `validate.max_map_drop` below the baseline's. A passing model also gets its DeepStream nvinfer config.

    Args:
        validate_spec: The spec's validate view (sections dataset, model, evaluate, engine, validate), as YAML;
            its data paths are replaced by the prepared data set's.
        variant: The variant's name (fp32, ptq, ptq-partial or qat); names the task's stage, the report and the
            DeepStream config.
        dataset: The prepared data set (prepare-data's `dataset`); its val split is scored.
        engine: The variant's engine folder (build-engine's `engine`); its bench.json, when there, is copied into
            the results.
        onnx_model: The ONNX model the engine was built from, for TensorRT's emulated numbers and the DeepStream
            config; the file is its `file` metadata (default model.onnx).
        baseline: The FP32 evaluation folder (evaluate's `results`); its metrics.json holds the baseline mAP.
        same_as: Another variant's validation (ptq-partial's task gets PTQ's `results`): its scores are taken
            wherever they scored the same model bytes on the same images, and the model runs wherever not.

    Returns:
        results: Folder with validation.json and validation.md, the evaluation's files, bench.json, and
            tensorrt_emulated/ and deepstream/ where made; its metadata names the variant, the verdict and the
            engine.
        metrics: mAP@0.5, mAP@[.5:.95], the mAP@0.5 drop, TensorRT's emulated mAP@0.5 where scored, the DLA form's
            emulated mAP@0.5 under export.target dla, and passed.
        report: validation.md (the engine's mAP against the baseline, and the verdict), as Markdown.
        Output: Whether the variant passed the gate (a single output: kfp.local's dsl.If resolves only those).
    """
    from pathlib import Path

    from qatpipe.data.prepare import spec_with_prepared_dataset
    from qatpipe.stages.evaluate import METRICS_FILE
    from qatpipe.stages.validate import MARKDOWN_FILE, validate as validate_stage
    from qatpipe_kfp.runtime import load_stage_spec, stage, write_metrics, write_text

    with stage(f"validate-{variant}", record=results):
        spec = spec_with_prepared_dataset(load_stage_spec(validate_spec), dataset.path)
        onnx_file = Path(onnx_model.path) / onnx_model.metadata.get("file", "model.onnx")
        result = validate_stage(spec, engine.path, Path(baseline.path) / METRICS_FILE, results.path, variant,
                                onnx_model=onnx_file, same_as=same_as.path if same_as is not None else None)
        results.metadata.update({"variant": variant, "passed": result["passed"], "engine": result["engine_label"]})
        write_metrics(metrics, {key: float(result[key]) for key in
                                ("map50", "map", "map50_drop", "map50_tensorrt_emulated", "map50_dla_emulated",
                                 "passed") if key in result})
        write_text(report, (Path(results.path) / MARKDOWN_FILE).read_text())
        return bool(result["passed"])
