import json
from pathlib import Path

from kfp import dsl

from qatpipe_kfp.compare.component import compare


def test_writes_table_chart_and_summary(artifact, tmp_path):
    evaluation = tmp_path / "eval"
    evaluation.mkdir()
    (evaluation / "metrics.json").write_text(json.dumps({"map50": 0.81, "map": 0.52, "model_size_mb": 3.2}))
    outputs = dict(summary=artifact(dsl.Artifact, "summary"), table=artifact(dsl.Markdown, "table"),
                   chart=artifact(dsl.HTML, "chart"), metrics=artifact(dsl.Metrics, "metrics"))
    compare.python_func(parent_run_id="", fp32=dsl.Artifact(uri=str(evaluation)), **outputs)
    summary = json.loads((Path(outputs["summary"].path) / "summary.json").read_text())
    assert summary["variants"]["fp32"] == {"map50": 0.81, "map": 0.52, "latency_ms_p50": None,
                                           "throughput": None, "size_mb": 3.2}
    assert "mlflow" not in summary  # tracking off
    assert "| fp32 | 0.8100 | 0.5200 | n/a | n/a | 3.20 |" in Path(outputs["table"].path).read_text()
    assert "data:image/png;base64," in Path(outputs["chart"].path).read_text()
    assert outputs["metrics"].metadata["fp32.map50"] == 0.81
