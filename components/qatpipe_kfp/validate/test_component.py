"""The contract the pipeline wires against; the body runs in tests/test_local_pipeline.py (it needs data and
an engine), the stage itself in tests/test_engines.py."""

from qatpipe_kfp.validate.component import validate


def test_interface():
    spec = validate.component_spec
    assert {k: v.type for k, v in spec.inputs.items()} == {
        "validate_spec": "String", "variant": "String", "dataset": "system.Dataset@0.0.1",
        "engine": "system.Model@0.0.1", "onnx_model": "system.Model@0.0.1", "baseline": "system.Artifact@0.0.1",
        "same_as": "system.Artifact@0.0.1"}
    assert spec.inputs["same_as"].optional  # only ptq-partial's task gets one (PTQ's validation)
    assert {k: v.type for k, v in spec.outputs.items()} == {
        "results": "system.Artifact@0.0.1", "metrics": "system.Metrics@0.0.1", "report": "system.Markdown@0.0.1",
        "Output": "Boolean"}
