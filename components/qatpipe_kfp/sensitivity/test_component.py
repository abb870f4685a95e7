"""The contract, and the body around the library: each model's report in its folder, one record for both, the
KFP UI's table and page, and the charts reaching MLflow. The measuring itself is faked here (tests/
test_sensitivity.py measures the tiny detector); tests/test_local_pipeline.py runs the body on the pipeline's
models."""

import json
from pathlib import Path

import numpy as np
import pytest
from kfp import dsl

from qatpipe_kfp.sensitivity.component import sensitivity


def test_interface():
    spec = sensitivity.component_spec
    assert {k: v.type for k, v in spec.inputs.items()} == {
        "sensitivity_spec": "String", "dataset": "system.Dataset@0.0.1", "fp32_onnx": "system.Model@0.0.1",
        "ptq_onnx": "system.Model@0.0.1", "qat_onnx": "system.Model@0.0.1"}
    assert {k: v.type for k, v in spec.outputs.items()} == {
        "results": "system.Artifact@0.0.1", "metrics": "system.Metrics@0.0.1", "table": "system.Markdown@0.0.1",
        "chart": "system.HTML@0.0.1"}


def _result(model_path, fp32_onnx, val_images):
    """A SensitivityResult as measure gives it: the qat model's layers barely matter, the ptq model's conv1 does."""
    from qatpipe.quantization.qdq_graph import FP32_WEIGHT
    from qatpipe.quantization.sensitivity import LayerSensitivity, SensitivityResult

    ptq = Path(model_path).parent.name == "ptq"
    drops = [("conv1", 0.09 if ptq else 0.004), ("block_1a_conv_1", 0.02 if ptq else 0.001), ("output_cov", 0.0)]
    layers = [LayerSensitivity(name, f"model/{name}/Conv2D", "Conv", 0.6 - drop, drop, 0.58 + drop / 2,
                               0.02 - drop / 2, drop / 2, FP32_WEIGHT) for name, drop in drops]
    return SensitivityResult(str(model_path), val_images, 0.6, 0.5 if ptq else 0.59, 15, layers,
                             {"model/conv9/Conv2D": 1e-4}, 0.6, str(fp32_onnx), seconds=1.5)


@pytest.fixture
def faked(monkeypatch, tmp_path):
    """The component's inputs, with the measuring faked: (inputs, models measured: [(model, fp32)])."""
    import qatpipe.inference
    import qatpipe.quantization.sensitivity as library
    import qatpipe.stages.sensitivity as stage
    from qatpipe.spec import bundled_spec_path, load_spec, stage_view

    measured = []

    def measure(model_path, score, layers, max_layers, fp32_onnx, screening_batch=None):
        measured.append((Path(model_path), Path(fp32_onnx)))
        return _result(model_path, fp32_onnx, 0)

    monkeypatch.setattr(library, "measure", measure)
    monkeypatch.setattr(qatpipe.inference, "onnx_forward", lambda path, arch: None)
    monkeypatch.setattr(stage, "val_sample", lambda spec, arch: (
        [None] * spec.sensitivity.val_images, lambda path: 0.5, [np.zeros((1, 8, 8, 3))], "CPUExecutionProvider"))
    data = tmp_path / "dataset"
    data.mkdir()
    (data / "dataset.json").write_text(json.dumps({"train": "train", "val": "val"}))
    spec = load_spec(bundled_spec_path("tiny"), ["sensitivity.val_images=24"])
    models = {}
    for name, file in (("fp32", "model.onnx"), ("ptq", "model.onnx"), ("qat", "qat.onnx")):
        (tmp_path / name).mkdir()
        (tmp_path / name / file).write_bytes(b"onnx")
        models[f"{name}_onnx"] = dsl.Model(uri=str(tmp_path / name), metadata={"file": file})
    inputs = dict(sensitivity_spec=stage_view(spec, "sensitivity"), dataset=dsl.Dataset(uri=str(data)), **models)
    return inputs, measured


def test_each_model_in_its_folder_one_record_and_the_ui_gets_tables_and_charts(faked, artifact, tmp_path,
                                                                                local_mlflow):
    from mlflow.tracking import MlflowClient

    from qatpipe.tracking.mlflow_runs import MlflowTracker
    from qatpipe.tracking.records import StageRecord

    inputs, measured = faked
    outputs = dict(results=artifact(dsl.Artifact, "results"), metrics=artifact(dsl.Metrics, "metrics"),
                   table=artifact(dsl.Markdown, "table"), chart=artifact(dsl.HTML, "chart"))
    sensitivity.python_func(**inputs, **outputs)
    # both models measured against the FP32 ONNX, each the file its artifact's metadata names
    assert measured == [(tmp_path / "ptq" / "model.onnx", tmp_path / "fp32" / "model.onnx"),
                        (tmp_path / "qat" / "qat.onnx", tmp_path / "fp32" / "model.onnx")]
    folder = Path(outputs["results"].path)
    for name in ("ptq", "qat"):  # each model's report as `qatpipe sensitivity` writes it, without a record
        assert {p.name for p in (folder / name).iterdir()} == {"sensitivity.json", "sensitivity.png",
                                                              "sensitivity.md"}
        report = json.loads((folder / name / "sensitivity.json").read_text())
        assert report["val_images"] == 24 and report["layers"][0]["name"] == "conv1"
    # one record for the stage: the metrics per model, the reports and charts its artifacts
    record = StageRecord.read(folder)
    assert record.stage == "sensitivity"
    assert record.artifacts == ["sensitivity.md", "sensitivity.html", "ptq", "qat"]
    assert record.metrics["ptq.map50_int8"] == 0.5 and record.metrics["qat.map50_int8"] == 0.59
    assert record.metrics["ptq.max_drop_only_int8"] == 0.09 and record.metrics["ptq.layers_measured"] == 3
    assert record.metrics["ptq.map50_fp32_onnx"] == 0.6 and record.metrics["seconds"] == 3.0
    assert record.params["ptq.model"] == "model.onnx" and record.params["sensitivity.val_images"] == 24
    assert record.tags == {"sensitivity.ptq.most_sensitive": "model/conv1/Conv2D",
                           "sensitivity.qat.most_sensitive": "model/conv1/Conv2D"}
    assert outputs["metrics"].metadata["qat.max_drop_only_int8"] == 0.004
    # the KFP UI: the overview (a row per model) over both tables, and the page with both bar charts
    table = Path(outputs["table"].path).read_text()
    assert "| ptq | 24 | 0.6000 | 0.5000 | +10.00 | 0.6000 | 3 / 15 | conv1 (+9.00), block_1a_conv_1 (+2.00), " \
           "output_cov (+0.00) |" in table
    assert "# Layer sensitivity of the ptq model (model.onnx)" in table
    assert "# Layer sensitivity of the qat model (qat.onnx)" in table
    assert "| 1 | conv1 | `model/conv1/Conv2D` | Conv | 0.5100 | +9.00 |" in table
    page = Path(outputs["chart"].path).read_text()
    assert page.count("data:image/png;base64,") == 2 and "<h4>qat model</h4>" in page
    assert page.index("<h4>ptq model</h4>") < page.index("<h4>qat model</h4>")
    # log-sensitivity: the charts and reports land in MLflow under the model's name
    parent = MlflowTracker(local_mlflow).start_pipeline_run("exp", "p", {})
    run_id = MlflowTracker(local_mlflow).log_stage(parent, record, folder)
    client = MlflowClient(local_mlflow)
    logged = {a.path for a in client.list_artifacts(run_id)} | {
        a.path for name in ("ptq", "qat") for a in client.list_artifacts(run_id, name)}
    assert {"sensitivity.md", "sensitivity.html", "ptq/sensitivity.png", "ptq/sensitivity.json",
            "qat/sensitivity.png"} <= logged
    assert client.get_run(run_id).data.metrics["ptq.max_recovery"] == 0.045


def test_a_model_that_fits_no_detector_fails_before_any_is_measured(faked, artifact, monkeypatch):
    import qatpipe.inference
    from qatpipe.errors import QatpipeError

    inputs, measured = faked

    def forward(path, arch):
        if path.name == "qat.onnx":
            raise QatpipeError(f"{path}: outputs do not fit the detector")

    monkeypatch.setattr(qatpipe.inference, "onnx_forward", forward)
    outputs = dict(results=artifact(dsl.Artifact, "results"), metrics=artifact(dsl.Metrics, "metrics"),
                   table=artifact(dsl.Markdown, "table"), chart=artifact(dsl.HTML, "chart"))
    with pytest.raises(QatpipeError, match="qat.onnx: outputs do not fit the detector"):
        sensitivity.python_func(**inputs, **outputs)
    assert measured == []  # the ptq model was not measured first, then thrown away
