"""The contract, and the body around the stage function (faked here: tests/test_sensitivity.py runs the search on
the tiny detector, tests/test_local_pipeline.py this body on the pipeline's models)."""

import json
from pathlib import Path

import pytest
from kfp import dsl

from qatpipe_kfp.ptq_partial.component import ptq_partial


def test_interface():
    spec = ptq_partial.component_spec
    assert {k: v.type for k, v in spec.inputs.items()} == {
        "ptq_partial_spec": "String", "dataset": "system.Dataset@0.0.1", "fp32_onnx": "system.Model@0.0.1",
        "ptq_onnx": "system.Model@0.0.1", "sensitivity": "system.Artifact@0.0.1"}
    assert {k: v.type for k, v in spec.outputs.items()} == {
        "onnx_model": "system.Model@0.0.1", "metrics": "system.Metrics@0.0.1", "report": "system.Markdown@0.0.1"}


def test_the_body_reads_the_ptq_models_ranking_and_says_what_it_kept_float(artifact, monkeypatch, tmp_path):
    import qatpipe.stages.ptq_partial as stage
    from qatpipe.spec import bundled_spec_path, load_spec, stage_view
    from qatpipe.tracking.records import StageRecord

    called = {}

    def fake(spec, fp32_onnx, ptq_onnx, output, sensitivity_dir=None):
        """What the stage writes and returns: two layers float met the budget on the third model scored, on the
        sample and then on all 200 val images."""
        called.update(spec=spec, fp32=fp32_onnx, ptq=ptq_onnx, output=output, sensitivity=sensitivity_dir)
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_bytes(b"onnx")
        steps = [{"float_layers": [], "map50": 0.50}, {"float_layers": ["m/conv1/Conv2D"], "map50": 0.55},
                 {"float_layers": ["m/conv1/Conv2D", "m/conv2/Conv2D"], "map50": 0.585, "map50_all": 0.59}]
        report = {"keep_float": "auto", "val_images": 24, "scored_by": "ONNX Runtime CPU, exact CPU form",
                  "float_layers": steps[-1]["float_layers"], "map50": 0.585, "map50_fp32": 0.6, "map50_int8": 0.5,
                  "target": 0.58, "budget": 0.02, "budget_met": True, "mode": "auto", "layers_total": 15,
                  "steps": steps, "seconds": 3.0, "size_mb": 0.4, "map50_all": 0.59, "map50_fp32_all": 0.605,
                  "val_images_all": 200}
        (output.parent / stage.REPORT_FILE).write_text(json.dumps(report))
        StageRecord(stage="ptq_partial", metrics={"float_layers": 2, "map50_subset": 0.585, "budget_met": 1},
                    artifacts=[output.name, stage.REPORT_FILE]).write(output.parent)
        return report

    monkeypatch.setattr(stage, "ptq_partial", fake)
    data = tmp_path / "dataset"
    data.mkdir()
    (data / "dataset.json").write_text(json.dumps({"train": "train", "val": "val"}))
    spec = load_spec(bundled_spec_path("tiny"), ["validate.max_map_drop=0.02", "export.fp16_onnx=false"])
    outputs = dict(onnx_model=artifact(dsl.Model, "onnx_model"), metrics=artifact(dsl.Metrics, "metrics"),
                   report=artifact(dsl.Markdown, "report"))
    ptq_partial.python_func(
        ptq_partial_spec=stage_view(spec, "ptq_partial"), dataset=dsl.Dataset(uri=str(data)),
        fp32_onnx=dsl.Model(uri=str(tmp_path / "fp32"), metadata={"file": "model.onnx"}),
        ptq_onnx=dsl.Model(uri=str(tmp_path / "ptq"), metadata={"file": "model.onnx"}),
        sensitivity=dsl.Artifact(uri=str(tmp_path / "sensitivity")), **outputs)
    # the PTQ model's ranking (the sensitivity stage's ptq/ folder), the view's budget and data paths
    assert called["sensitivity"] == tmp_path / "sensitivity" / "ptq"
    assert (called["fp32"], called["ptq"]) == (tmp_path / "fp32" / "model.onnx", tmp_path / "ptq" / "model.onnx")
    assert called["output"] == Path(outputs["onnx_model"].path) / "model.onnx"
    assert called["spec"].validate_.max_map_drop == 0.02 and called["spec"].export.fp16_onnx is False
    assert called["spec"].dataset.val == str(data / "val")
    # an ONNX model artifact as ptq's, naming its variant and float layers
    metadata = outputs["onnx_model"].metadata
    assert metadata["variant"] == "ptq-partial" and metadata["file"] == "model.onnx"
    assert metadata["float_layers"] == ["m/conv1/Conv2D", "m/conv2/Conv2D"]
    assert metadata["quantization"] == "int8 Q/DQ, PTQ with 2 of 15 layers float"
    assert outputs["metrics"].metadata["map50_subset"] == 0.585
    report = Path(outputs["report"].path).read_text()
    assert report.startswith("# ptq-partial: 2 of 15 layers float")
    assert "budget 2.00 points (validate.max_map_drop), target 0.5800: met." in report
    assert "scored on all 200 val images too (FP32 0.6050 there)" in report
    assert "| 2 | 2 | 0.5850 | +1.50 | 0.5900, +1.50 | `m/conv2/Conv2D` |" in report  # the step that met the budget
    assert "| 0 | 0 | 0.5000 | +10.00 |  | none |" in report  # the sample failed it: not scored on all images


def test_the_spec_view_holds_what_the_stage_reads():
    import yaml

    from qatpipe.spec import bundled_spec_path, load_spec, stage_view

    view = yaml.safe_load(stage_view(load_spec(bundled_spec_path("tiny")), "ptq_partial"))
    assert list(view) == ["dataset", "model", "evaluate", "export", "ptq", "sensitivity", "validate"]
    assert view["ptq"]["keep_float"] == "auto"


@pytest.mark.parametrize("view", ["sensitivity", "ptq_partial"])
def test_resolve_spec_hands_each_new_stage_its_view(view):
    from qatpipe_kfp.resolve_spec.component import resolve_spec

    assert f"{view}_spec" in resolve_spec.component_spec.outputs
