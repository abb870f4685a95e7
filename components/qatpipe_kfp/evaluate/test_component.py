"""The contract the pipeline wires against; the body runs in tests/test_local_pipeline.py (it needs a model)."""

from qatpipe_kfp.evaluate.component import evaluate


def test_interface():
    spec = evaluate.component_spec
    assert {k: v.type for k, v in spec.inputs.items()} == {
        "evaluate_spec": "String", "variant": "String", "dataset": "system.Dataset@0.0.1",
        "model": "system.Model@0.0.1"}
    assert {k: v.type for k, v in spec.outputs.items()} == {
        "results": "system.Artifact@0.0.1", "metrics": "system.Metrics@0.0.1",
        "report": "system.Markdown@0.0.1", "pr_curves": "system.HTML@0.0.1"}
