"""The contract the pipeline wires against; the body runs in tests/test_local_pipeline.py (it trains)."""

from qatpipe_kfp.retrain.component import retrain


def test_interface():
    spec = retrain.component_spec
    assert {k: v.type for k, v in spec.inputs.items()} == {
        "retrain_spec": "String", "qat": "Boolean", "dataset": "system.Dataset@0.0.1",
        "pruned": "system.Model@0.0.1"}
    assert {k: v.type for k, v in spec.outputs.items()} == {"model": "system.Model@0.0.1",
                                                            "metrics": "system.Metrics@0.0.1"}
