"""The contract, and the body without a tracking server; with one, tests/test_local_pipeline.py registers the
pipeline's models (a real MLflow server) and tests/test_mlflow_models.py covers the library it calls."""

from kfp import dsl

from qatpipe_kfp.register.component import register


def test_interface():
    spec = register.component_spec
    models = ("fp32_onnx", "ptq_onnx", "ptq_partial_onnx", "qat_onnx", "qat_engine")
    validations = ("fp32_validation", "ptq_validation", "ptq_partial_validation", "qat_validation")
    assert {k: v.type for k, v in spec.inputs.items()} == {
        "parent_run_id": "String", "spec": "String", "kfp_run_id": "String", "kfp_ui_url": "String",
        "dataset": "system.Dataset@0.0.1", **{name: "system.Model@0.0.1" for name in models},
        **{name: "system.Artifact@0.0.1" for name in validations}}
    assert {k: v.type for k, v in spec.outputs.items()} == {"Output": "String", "report": "system.Markdown@0.0.1"}


def test_without_tracking_nothing_is_registered_and_the_report_says_so(artifact, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    inputs = {name: artifact(dsl.Model, name) for name in ("fp32_onnx", "ptq_onnx", "ptq_partial_onnx", "qat_onnx",
                                                           "qat_engine")}
    inputs.update({name: artifact(dsl.Artifact, name) for name in ("fp32_validation", "ptq_validation",
                                                                    "ptq_partial_validation", "qat_validation")})
    report = artifact(dsl.Markdown, "report")
    assert register.python_func(parent_run_id="", spec="{}", kfp_run_id="k", kfp_ui_url="",
                                dataset=artifact(dsl.Dataset, "dataset"), report=report, **inputs) == ""
    assert "no models were logged" in open(report.path).read()
