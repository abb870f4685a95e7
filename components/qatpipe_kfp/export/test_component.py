import json
from pathlib import Path

from kfp import dsl

from qatpipe_kfp.export.component import export


def test_exports_fp32_onnx_with_tracking_record(artifact, tmp_path):
    from qatpipe.fileio import save_keras_model
    from qatpipe.models import get_architecture
    from qatpipe.spec import bundled_spec_path, load_spec, stage_view

    spec = load_spec(bundled_spec_path("tiny"))
    save_keras_model(get_architecture(spec).build_model(), tmp_path / "trained" / "model.keras")
    outputs = dict(onnx_model=artifact(dsl.Model, "onnx"), metrics=artifact(dsl.Metrics, "metrics"))
    export.python_func(export_spec=stage_view(spec, "export"), variant="fp32",
                       model=dsl.Model(uri=str(tmp_path / "trained")), **outputs)
    folder = Path(outputs["onnx_model"].path)
    assert outputs["onnx_model"].metadata["file"] == "model.onnx"
    assert outputs["onnx_model"].metadata["quantization"] == "none (FP32)"
    record = json.loads((folder / "tracking.json").read_text())
    assert record["stage"] == "export_fp32" and record["artifacts"] == ["model.onnx", "model_export.json"]
    assert outputs["metrics"].metadata["output_bbox.max_abs_difference_vs_tf"] < 1e-3


def test_interface():
    spec = export.component_spec
    assert {k: v.type for k, v in spec.inputs.items()} == {"export_spec": "String", "variant": "String",
                                                           "model": "system.Model@0.0.1"}
    assert set(spec.outputs) == {"onnx_model", "metrics"}
