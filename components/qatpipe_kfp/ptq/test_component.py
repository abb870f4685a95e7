"""The contract the pipeline wires against; the body runs in tests/test_local_pipeline.py (it needs data)."""

from qatpipe_kfp.ptq.component import ptq


def test_interface():
    spec = ptq.component_spec
    assert {k: v.type for k, v in spec.inputs.items()} == {
        "ptq_spec": "String", "dataset": "system.Dataset@0.0.1", "fp32_onnx": "system.Model@0.0.1"}
    assert {k: v.type for k, v in spec.outputs.items()} == {"int8_onnx": "system.Model@0.0.1",
                                                            "metrics": "system.Metrics@0.0.1",
                                                            "precision": "system.Markdown@0.0.1"}
