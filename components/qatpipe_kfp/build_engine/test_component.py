import json
from pathlib import Path

from kfp import dsl

from qatpipe_kfp.build_engine.component import build_engine


def test_builds_and_benchmarks_an_onnx_runtime_engine(artifact, tmp_path):
    from qatpipe.export.onnx_export import export_onnx
    from qatpipe.models import get_architecture
    from qatpipe.spec import bundled_spec_path, load_spec, stage_view

    spec = load_spec(bundled_spec_path("tiny"), ["engine.backend=onnxruntime"])
    export_onnx(get_architecture(spec).build_model(), tmp_path / "onnx" / "model.onnx", 17)
    outputs = dict(engine=artifact(dsl.Model, "engine"), metrics=artifact(dsl.Metrics, "metrics"))
    build_engine.python_func(engine_spec=stage_view(spec, "engine"), variant="fp32",
                             onnx_model=dsl.Model(uri=str(tmp_path / "onnx")), **outputs)
    folder = Path(outputs["engine"].path)
    assert {"model.onnx", "engine.json", "bench.json", "tracking.json"} <= {p.name for p in folder.iterdir()}
    assert outputs["engine"].metadata["backend"] == "onnxruntime"
    record = json.loads((folder / "tracking.json").read_text())
    assert record["stage"] == "build_engine_fp32" and "bench.json" in record["artifacts"]
    assert record["metrics"]["batch4.throughput"] > 0 and record["metrics"]["batch1.latency_ms_p50"] > 0
    assert outputs["metrics"].metadata["batch1.latency_ms_p50"] > 0


def test_interface():
    spec = build_engine.component_spec
    assert {k: v.type for k, v in spec.inputs.items()} == {"engine_spec": "String", "variant": "String",
                                                           "onnx_model": "system.Model@0.0.1", "gpu_type": "String",
                                                           "same_as": "system.Model@0.0.1"}
    assert spec.inputs["same_as"].optional  # only ptq-partial's task gets one (PTQ's engine)
    assert set(spec.outputs) == {"engine", "metrics"}
