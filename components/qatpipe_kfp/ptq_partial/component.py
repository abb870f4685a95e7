"""ptq-partial: the PTQ model with its most sensitive layers kept float (the sensitivity stage's ranking), fewest
first, until it scores within validate.max_map_drop of FP32; or with the layers `ptq.keep_float` names."""

from kfp.dsl import Artifact, Dataset, Input, Markdown, Metrics, Model, Output

from qatpipe_kfp.settings import component


@component
def ptq_partial(ptq_partial_spec: str, dataset: Input[Dataset], fp32_onnx: Input[Model], ptq_onnx: Input[Model],
                sensitivity: Input[Artifact], onnx_model: Output[Model], metrics: Output[Metrics],
                report: Output[Markdown]):
    """Build the ptq-partial variant: the PTQ model with its most accuracy-sensitive layers kept float.

    `ptq.keep_float: auto` keeps float the PTQ model's layers in the order of its sensitivity (the most recovered
    by keeping a layer float first), fewest first, until the model scores within `validate.max_map_drop` of the
    FP32 ONNX on the sensitivity stage's val sample, and then on every val image (the gate's images); a list names
    the layers. A float layer reads its input and
    the FP32 model's weights without Q/DQ, so TensorRT runs it in FP16 (the FP16 form) or FP32.

    Args:
        ptq_partial_spec: The spec's ptq_partial view (sections dataset, model, evaluate, export, ptq,
            sensitivity, validate), as YAML; its data paths are replaced by the prepared data set's.
        dataset: The prepared data set (prepare-data's `dataset`); the models are scored on the sensitivity
            stage's seeded sample of its val split, and the FP16 form's ranges recorded on its train split.
        fp32_onnx: The FP32 ONNX model folder (export's `onnx_model`): the float layers' weights and the mAP the
            budget is counted from.
        ptq_onnx: The PTQ INT8 ONNX model folder (ptq's `int8_onnx`) whose layers are kept float.
        sensitivity: The sensitivity stage's `results`: its ptq/sensitivity.json ranks the layers (keep_float auto).

    Returns:
        onnx_model: Folder with model.onnx (Q/DQ, the chosen layers float), ptq_partial.json (the layers kept
            float, every model scored in the search, the TensorRT Q/DQ rule check), with `export.fp16_onnx` and a
            float layer the FP16 form and its precision report, and tracking.json (no layer float: model.onnx is
            PTQ's bytes); its metadata names the framework, file, variant, quantization and the float layers.
        metrics: The layers kept float and still INT8, mAP@0.5 on the val sample of the chosen, the FP32 and the
            all-INT8 model, whether the budget was met, the model's size in MB.
        report: The layers kept float and the search, step by step, as Markdown.
    """
    import json
    from pathlib import Path

    from qatpipe.data.prepare import spec_with_prepared_dataset
    from qatpipe.stages.ptq_partial import REPORT_FILE, ptq_partial as ptq_partial_stage
    from qatpipe.tracking.records import StageRecord
    from qatpipe_kfp.runtime import load_stage_spec, stage, write_metrics, write_text

    with stage("ptq-partial", record=onnx_model):
        spec = spec_with_prepared_dataset(load_stage_spec(ptq_partial_spec), dataset.path)
        fp32 = Path(fp32_onnx.path) / fp32_onnx.metadata.get("file", "model.onnx")
        ptq = Path(ptq_onnx.path) / ptq_onnx.metadata.get("file", "model.onnx")
        output = Path(onnx_model.path) / "model.onnx"
        result = ptq_partial_stage(spec, fp32, ptq, output, Path(sensitivity.path) / "ptq")
        floats = result["float_layers"]
        onnx_model.metadata.update({
            "framework": "onnx", "file": output.name, "variant": "ptq-partial",
            "quantization": f"int8 Q/DQ, PTQ with {len(floats)} of {result['layers_total']} layers float",
            "float_layers": floats})
        if result.get("fp16"):
            onnx_model.metadata["fp16_file"] = Path(result["fp16"]["onnx"]).name
        write_metrics(metrics, StageRecord.read(output.parent).metrics)
        # the report for people: the budget, the layers kept float and each model the search scored
        lines = [f"# ptq-partial: {len(floats)} of {result['layers_total']} layers float", "",
                 f"`ptq.keep_float: {json.dumps(result['keep_float'])}`; mAP@0.5 on {result['val_images']} val "
                 f"images ({result['scored_by']}): FP32 {result['map50_fp32']:.4f}, every layer INT8 "
                 f"{result['map50_int8']:.4f}, this model {result['map50']:.4f}; budget "
                 f"{100 * result['budget']:.2f} points (validate.max_map_drop), target {result['target']:.4f}: "
                 f"{'met' if result['budget_met'] else 'NOT met'}.", "",
                 "| step | layers float | mAP@0.5 | drop from FP32 (points) | on all val images: mAP@0.5, drop "
                 "| last layer kept float |",
                 "|---|---|---|---|---|---|"]
        if result.get("map50_fp32_all") is not None:  # the sample's passes scored on every val image too
            lines[3:3] = ["", f"A model within the budget on the sample is scored on all {result['val_images_all']} "
                              f"val images too (FP32 {result['map50_fp32_all']:.4f} there) and kept only if within "
                              "it there."]
        for number, step in enumerate(result.get("steps", [])):
            last = f"`{step['float_layers'][-1]}`" if step["float_layers"] else "none"
            on_all = (f"{step['map50_all']:.4f}, {100 * (result['map50_fp32_all'] - step['map50_all']):+.2f}"
                      if step.get("map50_all") is not None else "")
            lines.append(f"| {number} | {len(step['float_layers'])} | {step['map50']:.4f} | "
                         f"{100 * (result['map50_fp32'] - step['map50']):+.2f} | {on_all} | {last} |")
        lines += ["", "Kept float: " + (", ".join(f"`{name}`" for name in floats) or "none") + ".",
                  f"Details: {REPORT_FILE} in the `onnx_model` folder."]
        write_text(report, "\n".join(lines) + "\n")
