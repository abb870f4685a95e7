"""The contract the pipeline wires against, and the skip: a spec that does not ask for the pipeline's pretrained
weights costs nothing. The stage's training is tested in tests/test_pretrain.py, and in the pipeline by
tests/test_local_pipeline.py."""

import json
from pathlib import Path

from kfp import dsl

from qatpipe_kfp.pretrain.component import pretrain


def test_interface():
    spec = pretrain.component_spec
    assert {k: v.type for k, v in spec.inputs.items()} == {"pretrain_spec": "String",
                                                           "dataset": "system.Dataset@0.0.1"}
    assert {k: v.type for k, v in spec.outputs.items()} == {"weights": "system.Model@0.0.1",
                                                            "metrics": "system.Metrics@0.0.1"}


def test_skips_unless_the_spec_asks_for_the_pipelines_weights(artifact, tmp_path):
    from qatpipe.spec import bundled_spec_path, load_spec, stage_view

    spec = load_spec(bundled_spec_path("tiny"))
    assert spec.model.pretrained is None
    outputs = dict(weights=artifact(dsl.Model, "weights"), metrics=artifact(dsl.Metrics, "metrics"))
    (tmp_path / "prepared").mkdir()  # never read: the stage stops before it looks at the data
    pretrain.python_func(pretrain_spec=stage_view(spec, "pretrain"),
                         dataset=dsl.Dataset(uri=str(tmp_path / "prepared")), **outputs)
    assert outputs["weights"].metadata == {"skipped": True}
    record = json.loads((Path(outputs["weights"].path) / "tracking.json").read_text())
    assert record["stage"] == "pretrain" and "not pipeline:pretrain" in record["params"]["skipped"]
    assert not (Path(outputs["weights"].path) / "weights.keras").exists()
