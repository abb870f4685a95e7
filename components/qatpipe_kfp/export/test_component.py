import json
from pathlib import Path

from kfp import dsl

from qatpipe_kfp.export.component import export


def test_exports_fp32_onnx_its_fp16_form_and_tracking_record(artifact, tmp_path):
    from qatpipe.data.prepare import prepare_dataset
    from qatpipe.export.bundle import ExportBundle
    from qatpipe.fileio import save_keras_model
    from qatpipe.models import get_architecture
    from qatpipe.spec import bundled_spec_path, load_spec, stage_view

    spec = load_spec(bundled_spec_path("tiny"))
    prepare_dataset(spec, tmp_path / "dataset")
    save_keras_model(get_architecture(spec).build_model(), tmp_path / "trained" / "model.keras")
    outputs = dict(onnx_model=artifact(dsl.Model, "onnx"), metrics=artifact(dsl.Metrics, "metrics"),
                   precision=artifact(dsl.Markdown, "precision"))
    export.python_func(export_spec=stage_view(spec, "export"), variant="fp32",
                       dataset=dsl.Dataset(uri=str(tmp_path / "dataset")),
                       model=dsl.Model(uri=str(tmp_path / "trained")), **outputs)
    folder = Path(outputs["onnx_model"].path)
    exported = ExportBundle(folder / "model.onnx")
    assert outputs["onnx_model"].metadata["file"] == exported.onnx.name
    assert outputs["onnx_model"].metadata["quantization"] == "none (FP32)"
    assert outputs["onnx_model"].metadata["fp16_file"] == exported.fp16.name
    record = json.loads((folder / "tracking.json").read_text())
    assert record["stage"] == "export_fp32" and record["artifacts"] == [
        exported.onnx.name, exported.report.name, exported.fp16.name, "precision_report.json", "precision_report.md"]
    metrics = outputs["metrics"].metadata
    assert metrics["output_bbox.max_abs_difference_vs_tf"] < 1e-3
    # an FP32 model: every node computes in FP16 but the output tail (the heads' sigmoid and transposes) and what the
    # guard keeps (nothing here)
    assert metrics["fp16_fp16_nodes"] > 0 and metrics["fp16_guard_flags"] == 0
    assert 0 < metrics["fp16_fp32_nodes"] <= 4
    assert "## FP16 form" in Path(outputs["precision"].path).read_text()


def test_interface():
    spec = export.component_spec
    assert {k: v.type for k, v in spec.inputs.items()} == {"export_spec": "String", "variant": "String",
                                                           "dataset": "system.Dataset@0.0.1",
                                                           "model": "system.Model@0.0.1"}
    assert set(spec.outputs) == {"onnx_model", "metrics", "precision"}
