"""The contract the pipeline wires against; the body runs in tests/test_local_pipeline.py (it trains)."""

from qatpipe_kfp.retrain.component import retrain

SCALE_OUT_INPUTS = {"gpus": "Integer", "workers": "Integer", "mpijob_api_version": "String", "launcher": "String",
                    "training_image": "String", "credentials_secret": "String", "node_selector": "Dict",
                    "tolerations": "List", "mpijob": "Boolean", "checkpoint_uri": "String"}


def test_interface():
    spec = retrain.component_spec
    assert {k: v.type for k, v in spec.inputs.items()} == {
        "retrain_spec": "String", "qat": "Boolean", "dataset": "system.Dataset@0.0.1",
        "pruned": "system.Model@0.0.1", "start": "system.Model@0.0.1", "baseline": "system.Model@0.0.1",
        **SCALE_OUT_INPUTS}
    assert spec.inputs["start"].optional  # only the retrains after the FP32 one get the FP32 retrain's model
    assert spec.inputs["baseline"].optional  # only the QAT task gets the FP32 baseline's
    assert spec.inputs["gpus"].default == 1 and spec.inputs["workers"].default == 1
    assert {k: v.type for k, v in spec.outputs.items()} == {"model": "system.Model@0.0.1",
                                                            "metrics": "system.Metrics@0.0.1",
                                                            "tensorboard": "system.Artifact@0.0.1"}
