import json
from pathlib import Path

from kfp import dsl

from qatpipe_kfp.prune.component import prune


def test_prunes_a_model_and_reports(artifact, tmp_path):
    from qatpipe.fileio import save_keras_model
    from qatpipe.models import get_architecture
    from qatpipe.spec import bundled_spec_path, load_spec, stage_view

    spec = load_spec(bundled_spec_path("tiny"), ["prune.threshold=0.95"])
    save_keras_model(get_architecture(spec).build_model(), tmp_path / "trained" / "model.keras")
    outputs = dict(pruned=artifact(dsl.Model, "pruned"), metrics=artifact(dsl.Metrics, "metrics"),
                   report=artifact(dsl.Markdown, "report"))
    prune.python_func(prune_spec=stage_view(spec, "prune"), model=dsl.Model(uri=str(tmp_path / "trained")),
                      **outputs)
    folder = Path(outputs["pruned"].path)
    assert {"model.keras", "prune_report.json", "tracking.json"} <= {p.name for p in folder.iterdir()}
    report = json.loads((folder / "prune_report.json").read_text())
    assert report["flops_after"] < report["flops_before"]
    assert outputs["pruned"].metadata["params"] == report["params_after"]
    assert outputs["metrics"].metadata["flops_ratio"] == report["flops_ratio"]
    assert outputs["metrics"].metadata["threshold_used"] == report["threshold_used"] == 0.95
    assert "| filters before | after |" in Path(outputs["report"].path).read_text()
    assert Path(outputs["report"].path).read_text() == (folder / "report.md").read_text()  # the stage's report
    assert "report.md" in json.loads((folder / "tracking.json").read_text())["artifacts"]


def test_interface():
    spec = prune.component_spec
    assert {k: v.type for k, v in spec.inputs.items()} == {"prune_spec": "String", "model": "system.Model@0.0.1"}
    assert set(spec.outputs) == {"pruned", "metrics", "report"}
