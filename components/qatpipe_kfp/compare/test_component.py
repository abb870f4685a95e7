import json
from pathlib import Path

from kfp import dsl

from qatpipe_kfp.compare.component import compare

PRUNE_REPORT = {"params_before": 1000, "params_after": 400, "flops_before": 2_000_000_000,
                "flops_after": 900_000_000, "flops_ratio": 0.45, "params_ratio": 0.4, "groups": []}


def _evaluation(folder: Path, map50: float, map_: float, size: float) -> dsl.Artifact:
    folder.mkdir()
    (folder / "metrics.json").write_text(json.dumps({"map50": map50, "map": map_, "model_size_mb": size}))
    return dsl.Artifact(uri=str(folder))


def test_writes_table_chart_summary_and_the_pruning_block(artifact, tmp_path):
    inputs = dict(
        fp32=_evaluation(tmp_path / "fp32", 0.81, 0.52, 1.6), ptq=_evaluation(tmp_path / "ptq", 0.78, 0.49, 0.5),
        qat=_evaluation(tmp_path / "qat", 0.80, 0.51, 0.5), unpruned=_evaluation(tmp_path / "unpruned", 0.82, 0.53, 4.0))
    (tmp_path / "pruned").mkdir()
    (tmp_path / "pruned" / "prune_report.json").write_text(json.dumps(PRUNE_REPORT))
    outputs = dict(summary=artifact(dsl.Artifact, "summary"), table=artifact(dsl.Markdown, "table"),
                   chart=artifact(dsl.HTML, "chart"), metrics=artifact(dsl.Metrics, "metrics"))
    compare.python_func(parent_run_id="", pruned=dsl.Model(uri=str(tmp_path / "pruned")), **inputs, **outputs)
    summary = json.loads((Path(outputs["summary"].path) / "summary.json").read_text())
    assert list(summary["variants"]) == ["fp32", "ptq", "qat"]
    assert summary["variants"]["fp32"] == {"map50": 0.81, "map": 0.52, "latency_ms_p50": None, "throughput": None,
                                           "size_mb": 1.6, "params": 400, "gflops": 0.9}
    assert summary["pruning"] == {**{k: v for k, v in PRUNE_REPORT.items() if k != "groups"},
                                  "unpruned_map50": 0.82, "unpruned_map": 0.53, "unpruned_size_mb": 4.0,
                                  "fp32_map50_change": -0.01}
    assert summary["gate_passed"] is None and "mlflow" not in summary  # tracking off
    table = Path(outputs["table"].path).read_text()
    assert "| qat | 0.8000 | 0.5100 | n/a | n/a | 0.50 | 400 | 0.900 |" in table
    assert "2.000 → 0.900 GFLOPs (x0.450)" in table and "retrained FP32 -1.00 points" in table
    assert "data:image/png;base64," in Path(outputs["chart"].path).read_text()
    assert outputs["metrics"].metadata["qat.map50"] == 0.80
    assert outputs["metrics"].metadata["pruning.flops_ratio"] == 0.45
