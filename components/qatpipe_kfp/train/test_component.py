"""The contract the pipeline wires against; the body runs in tests/test_local_pipeline.py (it trains)."""

from qatpipe_kfp.train.component import train

SCALE_OUT_INPUTS = {"gpus": "Integer", "workers": "Integer", "mpijob_api_version": "String", "launcher": "String",
                    "training_image": "String", "credentials_secret": "String", "node_selector": "Dict",
                    "tolerations": "List", "mpijob": "Boolean", "checkpoint_uri": "String"}


def test_interface():
    spec = train.component_spec
    assert {k: v.type for k, v in spec.inputs.items()} == {"train_spec": "String",
                                                           "dataset": "system.Dataset@0.0.1",
                                                           "pretrained": "system.Model@0.0.1", **SCALE_OUT_INPUTS}
    # one process on one node unless the pipeline says otherwise
    assert spec.inputs["gpus"].default == 1 and spec.inputs["workers"].default == 1
    assert {k: v.type for k, v in spec.outputs.items()} == {"model": "system.Model@0.0.1",
                                                            "metrics": "system.Metrics@0.0.1",
                                                            "tensorboard": "system.Artifact@0.0.1"}
