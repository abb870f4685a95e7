"""The contract; the body registers a model in tests/test_local_pipeline.py (a real MLflow server)."""

from qatpipe_kfp.register.component import register


def test_interface():
    spec = register.component_spec
    assert {k: v.type for k, v in spec.inputs.items()} == {
        "parent_run_id": "String", "model_name": "String", "onnx_model": "system.Model@0.0.1",
        "engine": "system.Model@0.0.1", "validation": "system.Artifact@0.0.1"}
    assert {k: v.type for k, v in spec.outputs.items()} == {"Output": "String"}
