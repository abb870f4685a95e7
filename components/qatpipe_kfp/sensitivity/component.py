"""sensitivity: which layers of the INT8 models cost their accuracy: per quantizable layer of the PTQ and the QAT
model, the mAP@0.5 drop on a val sample with only it INT8 and with every layer but it INT8 (docs/sensitivity.md)."""

from kfp.dsl import HTML, Artifact, Dataset, Input, Markdown, Metrics, Model, Output

from qatpipe_kfp.settings import component


@component
def sensitivity(sensitivity_spec: str, dataset: Input[Dataset], fp32_onnx: Input[Model], ptq_onnx: Input[Model],
                qat_onnx: Input[Model], results: Output[Artifact], metrics: Output[Metrics],
                table: Output[Markdown], chart: Output[HTML]):
    """Measure the layer sensitivity of the PTQ and the QAT model: per layer, the mAP@0.5 drop with only it INT8.

    Each quantizable layer of each model is scored twice on the same seeded sample of `sensitivity.val_images`
    val images (at most `sensitivity.max_layers` layers per model, the noisiest first): with only it INT8, and
    with every layer but it INT8; in ONNX Runtime with the Q/DQ in the exact CPU form (TensorRT's int8 numbers).
    The PTQ model's ranking is what the ptq-partial stage keeps float (`ptq.keep_float: auto`).

    Args:
        sensitivity_spec: The spec's sensitivity view (sections dataset, model, evaluate, sensitivity), as YAML;
            its data paths are replaced by the prepared data set's.
        dataset: The prepared data set (prepare-data's `dataset`); the models are scored on a seeded sample of
            its val split.
        fp32_onnx: The FP32 ONNX model folder (export's `onnx_model`): a layer kept float reads its weights where
            they match the quantized model's (the PTQ model's), and the report adds its mAP.
        ptq_onnx: The PTQ INT8 ONNX model folder (ptq's `int8_onnx`).
        qat_onnx: The QAT ONNX model folder (export's `onnx_model`, Q/DQ).

    Returns:
        results: Folder with ptq/ and qat/ (each model's sensitivity.json, most sensitive layer first,
            sensitivity.png and sensitivity.md), sensitivity.md and sensitivity.html (both models) and
            tracking.json.
        metrics: Per model (`ptq.`, `qat.`): mAP@0.5 with no layer INT8, with every layer INT8 and of the FP32
            ONNX, the layers measured and in all, the largest drop with one layer INT8 and the largest recovery
            keeping one layer float.
        table: Both models' overview and per-layer tables, as Markdown.
        chart: The tables and each model's bar chart (the drop per layer, most sensitive on top), as an HTML page.
    """
    from pathlib import Path

    from qatpipe.data.prepare import spec_with_prepared_dataset
    from qatpipe.stages.sensitivity import HTML_FILE, MARKDOWN_FILE, sensitivity_models
    from qatpipe.tracking.records import StageRecord
    from qatpipe_kfp.runtime import load_stage_spec, stage, write_metrics, write_text

    with stage("sensitivity", record=results):
        spec = spec_with_prepared_dataset(load_stage_spec(sensitivity_spec), dataset.path)
        models = {name: Path(model.path) / model.metadata.get("file", "model.onnx")
                  for name, model in (("ptq", ptq_onnx), ("qat", qat_onnx))}
        fp32 = Path(fp32_onnx.path) / fp32_onnx.metadata.get("file", "model.onnx")
        sensitivity_models(spec, fp32, models, results.path)
        folder = Path(results.path)
        results.metadata.update({"variants": list(models), "val_images": spec.sensitivity.val_images})
        write_metrics(metrics, StageRecord.read(folder).metrics)
        write_text(table, (folder / MARKDOWN_FILE).read_text())
        write_text(chart, (folder / HTML_FILE).read_text())
