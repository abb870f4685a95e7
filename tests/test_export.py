"""ONNX export (tf2onnx) and evaluation of the exported model in ONNX Runtime."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

from qatpipe.cli import main
from qatpipe.errors import ModelFileError, QatpipeError
from qatpipe.runtime.onnx_runtime import OnnxModel
from qatpipe.stages.export import export


@pytest.fixture(scope="module")
def trained_tiny(tiny_dataset, tmp_path_factory):
    """A briefly trained tiny detector (enough detections to compare evaluations)."""
    from qatpipe.spec import bundled_spec_path, load_spec
    from qatpipe.stages.train import train

    spec = load_spec(bundled_spec_path("tiny"), [f"dataset.train={tiny_dataset / 'train'}",
                                                 f"dataset.val={tiny_dataset / 'val'}", "train.epochs=6"])
    folder = tmp_path_factory.mktemp("trained")
    train(spec, folder)
    return spec, folder / "model.keras"


def test_export_matches_tensorflow_and_names_its_io(trained_tiny, tmp_path):
    spec, model = trained_tiny
    report = export(spec, model, tmp_path / "model.onnx")
    assert max(report["max_abs_difference_vs_tensorflow"].values()) < 1e-4
    proto = onnx.load(tmp_path / "model.onnx")
    onnx.checker.check_model(proto)
    assert [i.name for i in proto.graph.input] == ["input_1"]
    assert [o.name for o in proto.graph.output] == ["output_cov", "output_bbox"]
    assert proto.graph.input[0].type.tensor_type.shape.dim[0].dim_param == "batch"
    assert proto.opset_import[0].version == spec.export.opset
    assert json.loads((tmp_path / "model_export.json").read_text())["opset"] == spec.export.opset
    # dynamic batch: 1 and 3 images both run
    session = OnnxModel(tmp_path / "model.onnx")
    for batch in (1, 3):
        out = session.run(np.zeros((batch, 192, 320, 3), np.float32))
        assert out["output_cov"].shape == (batch, 12, 20, 3)


def test_onnx_evaluation_reproduces_the_keras_numbers(trained_tiny, tmp_path):
    spec, model = trained_tiny
    export(spec, model, tmp_path / "model.onnx")
    from qatpipe.stages.evaluate import evaluate

    keras_result = evaluate(spec, model, tmp_path / "keras")
    onnx_result = evaluate(spec, tmp_path / "model.onnx", tmp_path / "onnx")
    assert keras_result["map50"] > 0.05
    assert onnx_result["map50"] == pytest.approx(keras_result["map50"], abs=2e-3)
    assert onnx_result["map"] == pytest.approx(keras_result["map"], abs=2e-3)


def test_export_and_onnx_errors(trained_tiny, tmp_path, caplog):
    spec, model = trained_tiny
    with pytest.raises(QatpipeError, match="must end in .onnx"):
        export(spec, model, tmp_path / "model.pb")
    with pytest.raises(ModelFileError, match="missing.keras: model file not found"):
        export(spec, tmp_path / "missing.keras", tmp_path / "m.onnx")
    (tmp_path / "corrupt.onnx").write_bytes(b"\x08\x01garbage")
    with pytest.raises(ModelFileError, match="corrupt.onnx: not a loadable ONNX model"):
        OnnxModel(tmp_path / "corrupt.onnx")
    with pytest.raises(ModelFileError, match="nothere.onnx: model file not found"):
        OnnxModel(tmp_path / "nothere.onnx")
    # an ONNX file of another input size is refused by evaluate, naming both sizes
    from qatpipe.stages.evaluate import evaluate

    other = spec.model_copy(deep=True)
    other.dataset.image_size.height = 96
    from qatpipe.export.onnx_export import export_onnx
    from qatpipe.models import get_architecture

    export_onnx(get_architecture(other).build_model(), tmp_path / "small.onnx", 17)
    with pytest.raises(ModelFileError, match="input is 96x320, the spec's dataset.image_size is 192x320"):
        evaluate(spec, tmp_path / "small.onnx", tmp_path / "eval")
    # the command line: one clear line, exit code 2
    assert main(["export", "-e", "tiny", "-m", str(tmp_path / "missing.keras"), "-o", str(tmp_path / "x.onnx")]) == 2
    assert "missing.keras: model file not found" in caplog.text


@pytest.mark.parametrize("method", ["minmax", "entropy", "percentile"])
def test_ptq_gives_symmetric_int8_qdq_that_still_detects(trained_tiny, tmp_path, method):
    from onnx import numpy_helper

    from qatpipe.stages.evaluate import evaluate
    from qatpipe.stages.ptq import ptq

    spec, model = trained_tiny
    spec = spec.model_copy(deep=True)
    spec.ptq.method, spec.ptq.calibration_images = method, 32
    export(spec, model, tmp_path / "fp32.onnx")
    report = ptq(spec, tmp_path / "fp32.onnx", tmp_path / "ptq.onnx")
    assert report["calibration_images"] == 32 and report["method"] == method
    graph = onnx.load(tmp_path / "ptq.onnx").graph
    inits = {i.name: numpy_helper.to_array(i) for i in graph.initializer}
    quant = [n for n in graph.node if n.op_type == "QuantizeLinear"]
    convs = [n for n in graph.node if n.op_type == "Conv"]
    assert quant and convs
    for node in quant:  # symmetric int8: zero point 0 everywhere
        zero_point = inits[node.input[2]]
        assert zero_point.dtype == np.int8 and not zero_point.any()
    producers = {n.output[0]: n for n in graph.node}
    for conv in convs:  # every Conv reads its input and weights through DequantizeLinear
        data, weight = producers[conv.input[0]], producers[conv.input[1]]
        assert data.op_type == "DequantizeLinear" and weight.op_type == "DequantizeLinear", conv.name
        if weight.input[0] in inits:  # int8 weights with per-output-channel scales
            assert inits[weight.input[0]].dtype == np.int8
            assert inits[weight.input[1]].size == inits[weight.input[0]].shape[0]
    fp32 = evaluate(spec, tmp_path / "fp32.onnx", tmp_path / "e_fp32")["map50"]
    int8 = evaluate(spec, tmp_path / "ptq.onnx", tmp_path / "e_ptq")["map50"]
    assert int8 > 0.5 * fp32  # a sane INT8 model; the real comparison is bench/'s job
