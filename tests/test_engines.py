"""Engine backends, the latency harness, validation and its gate, the DeepStream hand-off.

TensorRT cannot be installed here (PyPI has only stub wheels) and there is no GPU: its tests run only where
`tensorrt` imports and a GPU is visible, and are skipped with that reason elsewhere, never faked.
"""

from __future__ import annotations

import json
import shutil
import time

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from qatpipe.cli import main
from qatpipe.engines import load_engine, select_backend
from qatpipe.engines.tensorrt_backend import TensorRTBackend
from qatpipe.errors import ModelFileError, QatpipeError
from qatpipe.export.bundle import ExportBundle
from qatpipe.stages.build_engine import build_engine

TENSORRT_MISSING = TensorRTBackend.unavailable_reason()
needs_tensorrt = pytest.mark.skipif(TENSORRT_MISSING is not None, reason=f"TensorRT: {TENSORRT_MISSING}")


@pytest.fixture(scope="module")
def engines(trained_tiny, qat_export, tmp_path_factory):
    """ONNX Runtime engines of the tiny detector's FP32 export and of its QAT export."""
    from qatpipe.stages.export import export

    spec, model = trained_tiny
    qat_onnx = qat_export[2]
    folder = tmp_path_factory.mktemp("engines")
    export(spec, model, folder / "fp32.onnx")
    build_engine(spec, folder / "fp32.onnx", folder / "fp32_engine", backend="onnxruntime")
    build_engine(spec, qat_onnx, folder / "qat_engine", backend="onnxruntime")  # the default CPU form: auto
    forms = {}
    for form in ("exact", "fast"):
        forced = spec.model_copy(deep=True)
        forced.engine.cpu_form = form
        build_engine(forced, qat_onnx, folder / f"qat_{form}", backend="onnxruntime")
        forms[f"qat_{form}"] = (qat_onnx, folder / f"qat_{form}")
    return spec, {"fp32": (folder / "fp32.onnx", folder / "fp32_engine"), "qat": (qat_onnx, folder / "qat_engine"),
                  **forms}


def test_engine_json_written_before_the_typed_fields_reads_them_from_its_precision(tmp_path):
    """An engine.json from before compute_precision and cpu_form (a KFP cache, a registered model) still reads:
    the fields come from its precision string, once, where it is read."""
    from qatpipe.engines.base import EngineMetadata

    old = {"backend": "onnxruntime", "engine_file": "model.onnx", "source_onnx": "model.onnx", "source_sha256": "0",
           "precision": "int8 (explicit Q/DQ, CPU form fast)", "runtime_version": "1", "device": "cpu",
           "input_name": "input_1", "batch_profile": {"min": 1, "opt": 1, "max": 1}}
    (tmp_path / "engine.json").write_text(json.dumps(old))
    metadata = EngineMetadata.read(tmp_path)
    assert (metadata.compute_precision, metadata.cpu_form, metadata.label) == ("int8", "fast", "onnxruntime int8")
    (tmp_path / "engine.json").write_text(json.dumps({**old, "backend": "tensorrt", "precision": "fp16"}))
    assert (EngineMetadata.read(tmp_path).compute_precision, EngineMetadata.read(tmp_path).cpu_form) == ("fp16", None)


def test_auto_picks_onnx_runtime_where_tensorrt_cannot_run(caplog):
    if TENSORRT_MISSING is None:
        assert select_backend("auto").name == "tensorrt"
        return
    caplog.set_level("INFO")
    assert select_backend("auto").name == "onnxruntime"
    assert f"TensorRT not used: {TENSORRT_MISSING}" in caplog.text
    with pytest.raises(QatpipeError, match=f"engine backend tensorrt is not available here: {TENSORRT_MISSING}"):
        select_backend("tensorrt")
    with pytest.raises(QatpipeError, match="unknown engine backend 'openvino'"):
        select_backend("openvino")


def _unoptimised(path):
    """ONNX Runtime executing the graph as written (no fusion into integer kernels): the graph's numerics."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return lambda x: dict(zip([o.name for o in session.get_outputs()], session.run(None, {"input_1": x})))


def test_exact_cpu_form_computes_the_same_numbers_with_uint8_activations(engines):
    _, built = engines
    qat_onnx, engine_dir = built["qat_exact"]
    graph = onnx.load(engine_dir / "model.onnx").graph
    inits = {i.name: numpy_helper.to_array(i) for i in graph.initializer}
    activation_q = [n for n in graph.node if n.op_type == "QuantizeLinear" and n.input[0] not in inits]
    assert activation_q and all(inits[n.input[2]].dtype == np.uint8 and (inits[n.input[2]] == 128).all()
                                for n in activation_q)
    weights = [inits[n.input[0]] for n in graph.node if n.op_type == "DequantizeLinear" and n.input[0] in inits]
    assert weights and all(w.dtype == np.int8 for w in weights)  # weights stay symmetric int8
    assert json.loads((engine_dir / "engine.json").read_text())["extra"] == {
        "batch_norms_folded": 0, "activation_qdq_shifted_to_uint8": len(activation_q), "requantizations_merged": 0,
        "biases_quantized": 0, "residual_conv_outputs_quantized": 0}
    images = np.random.default_rng(0).uniform(size=(3, 192, 320, 3)).astype(np.float32)
    # the graph as written (no kernel fusion): identical numbers, not approximately
    expected, actual = _unoptimised(qat_onnx)(images), _unoptimised(engine_dir / "model.onnx")(images)
    for name in expected:
        np.testing.assert_array_equal(actual[name], expected[name])


def test_int8_kernels_are_exact_only_with_an_int32_dot_product():
    from qatpipe.engines.onnxruntime_backend import int8_kernels_exact

    assert int8_kernels_exact(frozenset({"avx2", "avx512bw", "avx512_vnni"}), "x86_64")
    assert int8_kernels_exact(frozenset({"avx2", "avx_vnni"}), "x86_64")
    assert int8_kernels_exact(frozenset({"amx_int8"}), "x86_64")
    assert not int8_kernels_exact(frozenset({"avx2", "avx512bw", "fma"}), "x86_64")  # vpmaddubsw: int16 sums
    assert int8_kernels_exact(frozenset(), "aarch64")


def test_cpu_int8_says_when_a_cpu_engines_speed_is_not_tensorrts():
    """The variant table's `CPU int8` note, for both kinds of CPU (the flags passed in, as /proc/cpuinfo gives
    them): only the fast form on int8 dot products that sum in int32 runs the integer kernels TensorRT's speed
    comes from; the exact form, or the fast form's saturating int16 sums, are not TensorRT's speed."""
    from qatpipe.engines.onnxruntime_backend import cpu_int8, int8_kernels_exact

    vnni, plain = frozenset({"avx2", "avx512bw", "avx512_vnni", "amx_int8"}), frozenset({"avx2", "avx512bw", "fma"})
    assert cpu_int8("fast", vnni, "x86_64") == {
        "form": "fast", "dot_products": ["amx_int8", "avx512_vnni"], "like_tensorrt": True,
        "note": "fast form on int8 dot products (amx_int8, avx512_vnni)"}
    assert cpu_int8("exact", plain, "x86_64") == {
        "form": "exact", "dot_products": [], "like_tensorrt": False,
        "note": "exact form (no VNNI/AMX) - speeds are not TensorRT's"}
    assert cpu_int8("fast", plain, "x86_64")["note"] == "fast form (no VNNI/AMX: int16 sums saturate) - speeds are " \
                                                        "not TensorRT's"
    forced = cpu_int8("exact", vnni, "x86_64")  # engine.cpu_form: exact on a VNNI CPU
    assert not forced["like_tensorrt"] and forced["note"] == ("exact form (few integer kernels; amx_int8, "
                                                              "avx512_vnni unused) - speeds are not TensorRT's")
    assert cpu_int8("fast", frozenset(), "aarch64")["like_tensorrt"]  # sdot/udot sum in int32
    for flags in (vnni, plain):  # the decision is the engines' own, the one engine.cpu_form auto builds by
        assert cpu_int8("fast", flags, "x86_64")["like_tensorrt"] == int8_kernels_exact(flags, "x86_64")


def test_default_cpu_engine_is_fast_only_where_the_integer_kernels_are_exact(engines):
    """engine.cpu_form auto: the fast form where VNNI or AMX sums int8 products in int32, else the exact form
    (on this session's AMD EPYC without AVX512 the fast form's detections were 5 points off the model's)."""
    from qatpipe.engines.onnxruntime_backend import int8_kernels_exact

    _, built = engines
    default = json.loads((built["qat"][1] / "engine.json").read_text())
    expected = "fast" if int8_kernels_exact() else "exact"
    assert default["cpu_form"] == expected
    assert default["precision"] == f"int8 (explicit Q/DQ, CPU form {expected})"  # for people
    same = json.loads((built[f"qat_{expected}"][1] / "engine.json").read_text())
    assert default["extra"] == same["extra"]  # the same rewrites as that form asked for by name


def test_fast_cpu_form_of_a_qdq_model_has_integer_kernels(engines, tmp_path):
    """The fast form, asked for by name: folded BN and integer convolutions (the labels say so)."""
    import onnxruntime as ort

    _, built = engines
    engine_dir = built["qat_fast"][1]
    metadata = json.loads((engine_dir / "engine.json").read_text())
    assert metadata["precision"] == "int8 (explicit Q/DQ, CPU form fast)"  # for people
    assert (metadata["compute_precision"], metadata["cpu_form"]) == ("int8", "fast")  # for code (validate)
    assert metadata["label"] == "onnxruntime cpu int8"
    fp32_metadata = json.loads((built["fp32"][1] / "engine.json").read_text())
    assert (fp32_metadata["label"], fp32_metadata["compute_precision"], fp32_metadata["cpu_form"]) == (
        "onnxruntime cpu fp32", "fp32", None)
    assert json.loads((built["qat_exact"][1] / "engine.json").read_text())["cpu_form"] == "exact"
    # the compute layers per precision, read from the source ONNX: every conv of the QAT model is INT8
    fp32_layers = json.loads((built["fp32"][1] / "engine.json").read_text())["layer_precision"]
    assert metadata["layer_precision"] == {"int8": fp32_layers["fp32"], "fp16": 0, "fp32": 0}
    graph = onnx.load(engine_dir / "model.onnx").graph
    assert not [n for n in graph.node if n.op_type == "BatchNormalization"]  # folded, as TensorRT does
    inits = {i.name: numpy_helper.to_array(i) for i in graph.initializer}
    weights = [inits[n.input[0]] for n in graph.node if n.op_type == "DequantizeLinear" and n.input[0] in inits
               and inits[n.input[0]].ndim == 4]
    assert len(weights) == 15 and all(w.dtype == np.int8 for w in weights)  # weights stay symmetric int8
    metadata = json.loads((engine_dir / "engine.json").read_text())
    assert metadata["extra"]["batch_norms_folded"] == 13
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "optimised.onnx")
    ort.InferenceSession(str(engine_dir / "model.onnx"), options, providers=["CPUExecutionProvider"])
    ops = [n.op_type for n in onnx.load(tmp_path / "optimised.onnx").graph.node]
    # every conv runs as an integer kernel but the two heads, whose outputs stay float; the 4 feeding a
    # residual Add had their outputs quantized with the Add's other input's scale, so the Adds are integer too
    assert ops.count("QLinearConv") == 13 and ops.count("QLinearAdd") == 4
    assert metadata["extra"]["residual_conv_outputs_quantized"] == 4


def test_fast_cpu_form_detects_like_the_model_where_int8_dot_products_sum_in_int32(engines, tmp_path):
    """Not the same numbers (folded scales round differently, uint8 saturates later than int8), but where the CPU's
    int8 dot products do not saturate (VNNI or AMX: auto's fast form), the same detections within 2 points.
    Elsewhere the fast form's sums saturate and nothing about its mAP holds: skipped, saying so (a CPU feature,
    which CI cannot install; the choice of the exact form there is checked on every CPU below)."""
    from qatpipe.devices import cpu_name
    from qatpipe.engines.onnxruntime_backend import EXACT_INT8_DOT_FLAGS, int8_kernels_exact
    from qatpipe.stages.evaluate import evaluate

    if not int8_kernels_exact():
        pytest.skip(f"this CPU ({cpu_name()}) has none of {', '.join(sorted(EXACT_INT8_DOT_FLAGS))}: ONNX Runtime's "
                    "integer kernels saturate there, so the fast form's detections are not expected to match")
    spec, built = engines
    qat_onnx, engine_dir = built["qat_fast"]
    fast = evaluate(spec, engine_dir, tmp_path / "fast")["map50"]
    assert fast == pytest.approx(evaluate(spec, qat_onnx, tmp_path / "onnx")["map50"], abs=0.02)


@pytest.mark.parametrize(("flags", "form"), [
    (frozenset({"avx2", "avx512bw", "fma"}), "exact"),  # vpmaddubsw's int16 sums saturate: the exact form
    (frozenset({"avx2", "avx512bw", "avx512_vnni"}), "fast"),
    (frozenset({"avx2", "amx_int8"}), "fast"),
])
def test_auto_cpu_form_follows_the_cpus_int8_dot_product(engines, tmp_path, monkeypatch, caplog, flags, form):
    """engine.cpu_form auto on x86 CPUs with and without an int8 dot product that sums in int32, on every machine:
    the CPU's flags are the one part played here (qatpipe.devices.cpu_flags; this machine's CPU cannot be changed),
    the engine is built for real. Without VNNI or AMX: the exact form, and a warning that says why."""
    import platform

    from qatpipe import devices

    monkeypatch.setattr(devices, "cpu_flags", lambda *args: flags)
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    spec, built = engines
    qat_onnx = built["qat"][0]
    caplog.set_level("WARNING", logger="qatpipe")
    build_engine(spec, qat_onnx, tmp_path / "auto", backend="onnxruntime")
    metadata = json.loads((tmp_path / "auto" / "engine.json").read_text())
    assert metadata["cpu_form"] == form
    assert metadata["extra"] == json.loads((built[f"qat_{form}"][1] / "engine.json").read_text())["extra"]
    reasons = [r.getMessage() for r in caplog.records if "engine.cpu_form auto" in r.getMessage()]
    assert reasons == ([] if form == "fast" else [
        "engine.cpu_form auto: the exact CPU form, since this CPU has no VNNI or AMX int8 dot product and ONNX "
        "Runtime's integer kernels would saturate (set fast to build it anyway)"])


@pytest.mark.parametrize("variant", ["fp32", "qat"])
def test_engine_reproduces_the_evaluate_numbers(engines, variant, tmp_path):
    from qatpipe.stages.evaluate import evaluate

    spec, built = engines
    onnx_path, engine_dir = built[variant]
    if variant == "fp32":  # the same graph
        from_onnx = evaluate(spec, onnx_path, tmp_path / "onnx")
        from_engine = evaluate(spec, engine_dir, tmp_path / "engine")
        assert from_engine["map50"] == from_onnx["map50"] and from_engine["map"] == from_onnx["map"]
        return
    # The default form (fast where the CPU's int8 dot products cannot saturate): integer kernels and the folded
    # BN round differently from DQ -> float conv -> Q.
    # Scored on the 192 training images, not the 48 val images: on a model this weak one flipped detection
    # moves a 48-image mAP@0.5 by about a point either way (1.2 points on one machine's model, -1.35 on
    # another's), which is the bound's size, so the comparison needs the larger sample to mean anything.
    spec = spec.model_copy(deep=True)
    spec.dataset.val = spec.dataset.train
    from_onnx = evaluate(spec, onnx_path, tmp_path / "onnx")
    from_engine = evaluate(spec, engine_dir, tmp_path / "engine")
    assert from_engine["map50"] == pytest.approx(from_onnx["map50"], abs=0.01)
    assert from_engine["map"] == pytest.approx(from_onnx["map"], abs=0.01)
    # the exact form computes the Q/DQ graph's numbers: the same mAP
    from_exact = evaluate(spec, built["qat_exact"][1], tmp_path / "exact")
    assert from_exact["map50"] == from_onnx["map50"] and from_exact["map"] == from_onnx["map"]


def test_latency_harness_and_bench_report_schema(engines, tmp_path):
    from qatpipe.engines.latency import measure_latency
    from qatpipe.engines.onnxruntime_backend import cpu_int8
    from qatpipe.stages.bench_engine import bench_engine

    result = measure_latency(lambda batch: time.sleep(0.002), np.zeros((4, 2)), warmup=2, iterations=20)
    assert result.iterations >= 20 and result.batch_size == 4
    assert 2.0 <= result.latency_ms_p50 <= result.latency_ms_p95 <= result.latency_ms_p99
    assert result.throughput == pytest.approx(4000 / result.latency_ms_p50, rel=0.01)

    spec, built = engines
    spec = spec.model_copy(deep=True)
    spec.engine.bench.batch_sizes, spec.engine.bench.iterations, spec.engine.bench.min_seconds = [1, 2], 3, 0.0
    report = bench_engine(spec, built["qat"][1], tmp_path / "bench.json")
    assert json.loads((tmp_path / "bench.json").read_text()) == report
    assert set(report) == {"engine", "label", "backend", "precision", "device", "runtime_version", "model_size_mb",
                           "engine_size_mb", "peak_memory_mb", "batches", "settings", "cpu_int8"}
    assert report["settings"] == spec.engine.bench.model_dump(mode="json")  # what it was measured under
    assert report["label"] == "onnxruntime cpu int8"
    form = json.loads((built["qat"][1] / "engine.json").read_text())["cpu_form"]
    assert report["cpu_int8"] == cpu_int8(form)  # this CPU's int8 support, where the speed was measured
    assert [row["batch_size"] for row in report["batches"]] == [1, 2]
    assert set(report["batches"][0]) == {"batch_size", "iterations", "latency_ms_p50", "latency_ms_p95",
                                         "latency_ms_p99", "latency_ms_mean", "throughput"}
    assert report["peak_memory_mb"] > 50 and report["engine_size_mb"] > 0


def test_the_benchmark_joins_the_engine_record_and_travels_with_its_validation(engines, tmp_path):
    """bench-engine into the engine folder adds its figures to the engine's tracking record; validate copies
    bench.json beside its verdict, and only a passing model gets a DeepStream config, in the network mode of
    the engine's precision (engine.json), not of the variant's name."""
    from qatpipe.stages.bench_engine import bench_engine
    from qatpipe.stages.validate import validate

    spec, built = engines
    spec = spec.model_copy(deep=True)
    spec.engine.bench.batch_sizes, spec.engine.bench.iterations, spec.engine.bench.min_seconds = [1], 3, 0.0
    engine_dir = tmp_path / "engine"
    shutil.copytree(built["fp32"][1], engine_dir)
    report = bench_engine(spec, engine_dir)
    record = json.loads((engine_dir / "tracking.json").read_text())
    assert record["metrics"]["batch1.latency_ms_p50"] == report["batches"][0]["latency_ms_p50"]
    assert "bench.json" in record["artifacts"] and record["metrics"]["peak_memory_mb"] == report["peak_memory_mb"]

    low, high = tmp_path / "low.json", tmp_path / "high.json"
    low.write_text(json.dumps({"map50": 0.0, "map": 0.0}))
    high.write_text(json.dumps({"map50": 1.0, "map": 1.0}))
    passed = validate(spec, engine_dir, low, tmp_path / "passed", variant="int8-named-fp32")
    assert passed["passed"] and passed["benchmark"] == report
    assert json.loads((tmp_path / "passed" / "bench.json").read_text()) == report
    config = (tmp_path / "passed" / "deepstream" / "config_infer_primary_int8-named-fp32.txt").read_text()
    assert "network-mode=2" in config  # a float engine: FP16, whatever the variant is called
    assert "deepstream" in json.loads((tmp_path / "passed" / "tracking.json").read_text())["artifacts"]
    failed = validate(spec, engine_dir, high, tmp_path / "failed", variant="fp32")
    assert not failed["passed"] and not (tmp_path / "failed" / "deepstream").exists()
    qat = validate(spec, built["qat"][1], low, tmp_path / "qat", variant="qat")
    assert qat["passed"] and "benchmark" not in qat  # this engine was never benchmarked
    assert "network-mode=1" in (tmp_path / "qat" / "deepstream" / "config_infer_primary_qat.txt").read_text()


def test_a_variant_that_is_another_variants_model_takes_its_engine_benchmark_and_scores(engines, tmp_path,
                                                                                         monkeypatch):
    """A ptq-partial that keeps no layer float is PTQ's file: given PTQ's engine and validation (same_as), its
    engine is copied, its benchmark and scores taken, and nothing runs the model again; its own reports name it.
    Another model, or the same one under other engine settings, is built, measured and scored as without."""
    import qatpipe.stages.evaluate as evaluate_module
    from qatpipe.stages.bench_engine import bench_engine
    from qatpipe.stages.validate import validate

    spec, built = engines
    spec = spec.model_copy(deep=True)
    spec.engine.cpu_form, spec.engine.fp16 = "fast", True  # so the validation scores TensorRT's numbers beside it
    spec.engine.bench.batch_sizes, spec.engine.bench.iterations, spec.engine.bench.min_seconds = [1], 3, 0.0
    qat_onnx = built["qat"][0]
    baseline = tmp_path / "baseline.json"
    baseline.write_text(json.dumps({"map50": 0.0, "map": 0.0}))
    build_engine(spec, qat_onnx, tmp_path / "ptq_engine", backend="onnxruntime")
    measured = bench_engine(spec, tmp_path / "ptq_engine")
    scored = validate(spec, tmp_path / "ptq_engine", baseline, tmp_path / "ptq_val", "ptq", onnx_model=qat_onnx)
    assert "map50_tensorrt_emulated" in scored

    same = tmp_path / "partial" / "model.onnx"
    same.parent.mkdir()
    shutil.copyfile(qat_onnx, same)
    copied = build_engine(spec, same, tmp_path / "partial_engine", backend="onnxruntime", stage_name="build_p",
                          same_as=tmp_path / "ptq_engine")
    assert (tmp_path / "partial_engine" / "model.onnx").read_bytes() == \
        (tmp_path / "ptq_engine" / "model.onnx").read_bytes()
    assert copied["source_onnx"] == str(same) and copied["build_key"]
    record = json.loads((tmp_path / "partial_engine" / "tracking.json").read_text())
    assert record["stage"] == "build_p" and record["params"]["copied_from"] == str(tmp_path / "ptq_engine")
    taken = bench_engine(spec, tmp_path / "partial_engine", same_as=tmp_path / "ptq_engine")
    assert taken["batches"] == measured["batches"] and taken["measured_as"] == str(tmp_path / "ptq_engine")
    assert taken["engine"] == str(tmp_path / "partial_engine")

    def no_run(*args, **kwargs):
        raise AssertionError("the model ran again")

    with monkeypatch.context() as patched:
        patched.setattr(evaluate_module, "predict", no_run)
        partial = validate(spec, tmp_path / "partial_engine", baseline, tmp_path / "partial_val", "ptq-partial",
                           onnx_model=same, same_as=tmp_path / "ptq_val")
    for key in ("map50", "map", "map50_tensorrt_emulated", "passed"):
        assert partial[key] == scored[key], key
    for name in ("detections.json", "tensorrt_emulated/detections.json"):
        assert (tmp_path / "partial_val" / name).read_bytes() == (tmp_path / "ptq_val" / name).read_bytes()
    assert (tmp_path / "partial_val" / "validation.md").read_text().startswith("# Validation of ptq-partial")
    record = json.loads((tmp_path / "partial_val" / "tracking.json").read_text())
    assert record["stage"] == "validate_ptq_partial" and record["params"]["scores_from"] == str(tmp_path / "ptq_val")

    other = spec.model_copy(deep=True)
    other.engine.cpu_form = "exact"  # the same bytes under other engine settings: another engine
    rebuilt = build_engine(other, same, tmp_path / "exact_engine", backend="onnxruntime",
                           same_as=tmp_path / "ptq_engine")
    assert rebuilt["cpu_form"] == "exact" and rebuilt["build_key"] != copied["build_key"]
    assert "measured_as" not in bench_engine(other, tmp_path / "exact_engine", same_as=tmp_path / "ptq_engine")
    fp32 = validate(spec, built["fp32"][1], baseline, tmp_path / "fp32_val", "fp32", same_as=tmp_path / "ptq_val")
    plain = validate(spec, built["fp32"][1], baseline, tmp_path / "fp32_plain", "fp32")
    assert fp32["map50"] == plain["map50"] != scored["map50"]
    assert "scores_from" not in json.loads((tmp_path / "fp32_val" / "tracking.json").read_text())["params"]


def test_gate_passes_and_fails_on_constructed_metrics():
    from qatpipe.stages.validate import gate

    assert gate(0.80, 0.805, 0.01) == (True, pytest.approx(0.005))
    assert gate(0.79, 0.80, 0.01)[0] is True  # exactly the allowed drop passes
    assert gate(0.78, 0.80, 0.01) == (False, pytest.approx(0.02))
    assert gate(0.85, 0.80, 0.0) == (True, pytest.approx(-0.05))  # better than the baseline


def test_validate_writes_reports_and_the_command_exits_1_on_a_failed_gate(engines, tmp_path, caplog):
    from qatpipe.stages.evaluate import evaluate
    from qatpipe.stages.validate import validate

    spec, built = engines
    engine_dir = built["qat_fast"][1]  # the fast CPU form, whose exact form validate scores beside it
    own = evaluate(spec, engine_dir, tmp_path / "own")
    exact = evaluate(spec, built["qat_exact"][1], tmp_path / "exact")["map50"]  # TensorRT's numbers
    lenient = tmp_path / "lenient.json"
    lenient.write_text(json.dumps({"map50": max(own["map50"], exact) + 0.005, "map": own["map"]}))
    spec = spec.model_copy(deep=True)
    spec.engine.fp16 = False  # TensorRT's numbers are then the Q/DQ graph's in float32 (FP16: the next test)
    spec.validate_.max_map_drop = abs(own["map50"] - exact) + 0.006  # both figures pass
    report = validate(spec, engine_dir, lenient, tmp_path / "pass", variant="qat")
    assert report["passed"] and report["map50"] == own["map50"] and report["engine_label"] == "onnxruntime cpu int8"
    # the TensorRT-emulated mAP: the source ONNX in the exact form, scored beside the engine's
    assert report["map50_tensorrt_emulated"] == exact
    assert report["map50_tensorrt_emulated_drop"] == pytest.approx(max(own["map50"], exact) + 0.005 - exact,
                                                                   abs=1e-6)  # gate() rounds to 6 places
    assert (tmp_path / "pass" / "tensorrt_emulated" / "detections.json").is_file()
    markdown = (tmp_path / "pass" / "validation.md").read_text()
    assert markdown.startswith("# Validation of qat: PASSED") and "| qat (onnxruntime cpu int8) |" in markdown
    assert "| qat, TensorRT's numbers (emulated) |" in markdown
    assert json.loads((tmp_path / "pass" / "validation.json").read_text()) == report
    record = json.loads((tmp_path / "pass" / "tracking.json").read_text())
    assert record["metrics"]["map50_tensorrt_emulated"] == exact
    assert record["params"]["engine"] == report["engine_label"]
    # an engine that computes TensorRT's numbers itself, and a float one, have nothing to emulate
    for name, why in (("qat_exact", "computes TensorRT's numbers itself"), ("fp32", "fp32 engine")):
        other = validate(spec, built[name][1], lenient, tmp_path / name, variant=name)
        assert "map50_tensorrt_emulated" not in other and why in other["tensorrt_emulation"]
    with pytest.raises(QatpipeError, match="fp32.onnx: not the ONNX model .* was built from"):
        validate(spec, engine_dir, lenient, tmp_path / "wrong", variant="qat", onnx_model=built["fp32"][0])
    moved = tmp_path / "moved_engine"  # an engine whose source ONNX is no longer where engine.json says
    shutil.copytree(engine_dir, moved)
    metadata = json.loads((moved / "engine.json").read_text())
    (moved / "engine.json").write_text(json.dumps({**metadata, "source_onnx": str(tmp_path / "gone.onnx")}))
    with pytest.raises(QatpipeError, match="moved_engine: its source ONNX .*gone.onnx is not here"):
        validate(spec, moved, lenient, tmp_path / "moved", variant="qat")

    strict = tmp_path / "strict.json"
    strict.write_text(json.dumps({"map50": own["map50"] + 0.05, "map": own["map"]}))
    args = ["validate", "-e", "tiny", "--set", f"dataset.train={spec.dataset.train}",
            "--set", f"dataset.val={spec.dataset.val}", "-m", str(engine_dir), "--baseline", str(strict),
            "-o", str(tmp_path / "fail"), "--variant", "qat"]
    assert main(args) == 1
    assert "validation gate failed for qat: mAP@0.5" in caplog.text and "5.00 points below" in caplog.text
    assert json.loads((tmp_path / "fail" / "validation.json").read_text())["passed"] is False


def _planted_fp16_overflow(fp32_onnx, folder):
    """The detector with x1e5 then x1e-5 after its first Conv: the same numbers in float32, an overflow (inf)
    in FP16. With its FP16 form made without the guard (what a guard that missed a tensor would give) and the
    export's precision report beside it."""
    import onnx
    from onnx import helper

    from qatpipe.export import fp16
    from qatpipe.export.onnx_export import save_onnx

    model = onnx.load(fp32_onnx)
    graph = model.graph
    index, conv = next((i, n) for i, n in enumerate(graph.node) if n.op_type == "Conv")
    out = conv.output[0]
    conv.output[0] = "planted_in"
    graph.initializer.extend([numpy_helper.from_array(np.array(1e5, np.float32), "planted_up"),
                              numpy_helper.from_array(np.array(1e-5, np.float32), "planted_down")])
    graph.node.insert(index + 1, helper.make_node("Mul", ["planted_in", "planted_up"], ["planted_big"],
                                                  name="planted_amplify"))
    graph.node.insert(index + 2, helper.make_node("Mul", ["planted_big", "planted_down"], [out],
                                                  name="planted_attenuate"))
    folder.mkdir(parents=True, exist_ok=True)
    planted = save_onnx(model, folder / "model.onnx")
    save_onnx(fp16.convert(model, {})[0], ExportBundle(planted).fp16)
    return planted


def test_tensorrt_emulated_map_is_the_fp16_forms_and_a_broken_fp16_form_fails_with_its_report(engines, tmp_path,
                                                                                            caplog):
    """Under engine.fp16, TensorRT builds the export's FP16 form, so the TensorRT-emulated mAP is that form's
    (FP16 values rounded as FP16 holds them). A form whose FP16 arithmetic breaks the detector fails the gate,
    while the CPU engine itself passes, and the verdict carries the precision report that says where."""
    from qatpipe.data.pipeline import eval_dataset
    from qatpipe.data.splits import sample_split
    from qatpipe.export.precision import precision_report, write_report
    from qatpipe.stages.validate import validate

    spec, built = engines
    fp16_form = ExportBundle(built["fp32"][0]).fp16
    assert spec.engine.fp16 and fp16_form.is_file()
    low = tmp_path / "low.json"
    low.write_text(json.dumps({"map50": 0.0, "map": 0.0}))
    good = validate(spec, built["fp32"][1], low, tmp_path / "fp32", variant="fp32")
    assert good["passed"] and good["fp16_form"] and f"FP16 form {fp16_form.name}" in good["tensorrt_emulation"]
    assert (tmp_path / "fp32" / "tensorrt_emulated" / "fp16_rounded.onnx").is_file()
    assert abs(good["map50_tensorrt_emulated"] - good["map50"]) < 0.02  # the guarded FP16 form loses ~nothing
    assert (tmp_path / "fp32" / "fp16_precision_report.md").read_text() == \
        built["fp32"][0].with_name("precision_report.md").read_text()

    planted = _planted_fp16_overflow(built["fp32"][0], tmp_path / "planted")
    samples = sample_split(spec, "train", 4, seed=0)
    write_report(precision_report(planted, [b.numpy() for b in eval_dataset(samples, spec)]), planted.parent)
    build_engine(spec, planted, tmp_path / "planted_engine", backend="onnxruntime")
    baseline = tmp_path / "baseline.json"
    baseline.write_text(json.dumps({"map50": good["map50"], "map": good["map"]}))
    caplog.set_level("WARNING")
    broken = validate(spec, tmp_path / "planted_engine", baseline, tmp_path / "broken", variant="fp32")
    assert broken["map50"] == pytest.approx(good["map50"], abs=1e-3)  # the CPU engine runs float32: fine
    assert broken["map50_tensorrt_emulated"] < good["map50"] - 0.05 and not broken["passed"]
    assert "TensorRT-emulated mAP@0.5 (the FP16 form; fp16_precision_report.md says where it loses)" in caplog.text
    markdown = (tmp_path / "broken" / "validation.md").read_text()
    assert "## Why: the FP16 form loses accuracy" in markdown and "planted_big" in markdown
    assert not (tmp_path / "broken" / "deepstream").exists()


def test_the_gate_needs_the_tensorrt_emulated_map_too():
    """An INT8 engine passes only when both its own mAP and TensorRT's numbers are within the allowed drop; the
    message names the figure that failed."""
    from qatpipe.stages.validate import gate_message

    report = {"variant": "qat", "map50": 0.80, "map50_drop": 0.005, "map50_tensorrt_emulated": 0.78,
              "map50_tensorrt_emulated_drop": 0.025, "baseline_map50": 0.805, "max_map_drop": 0.01}
    message = gate_message(report)
    assert "TensorRT-emulated mAP@0.5 0.7800 is 2.50 points below the baseline 0.8050" in message
    assert "mAP@0.5 0.8000 is" not in message


def test_bad_engine_folders_and_baselines_are_named(engines, tmp_path):
    from qatpipe.stages.validate import read_baseline

    with pytest.raises(ModelFileError, match="nowhere: engine folder not found"):
        load_engine(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelFileError, match="empty: not an engine folder \\(no engine.json"):
        load_engine(tmp_path / "empty")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "engine.json").write_text("{not json")
    with pytest.raises(ModelFileError, match="broken/engine.json: unreadable engine metadata"):
        load_engine(broken)
    _, built = engines
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "engine.json").write_text((built["qat"][1] / "engine.json").read_text())
    (corrupt / "model.onnx").write_bytes(b"\x08\x01garbage")
    with pytest.raises(ModelFileError, match="corrupt/model.onnx: not a loadable ONNX model"):
        load_engine(corrupt)
    (tmp_path / "m.json").write_text(json.dumps({"map": 0.5}))
    with pytest.raises(QatpipeError, match="m.json: not an evaluation metrics.json"):
        read_baseline(tmp_path / "m.json")
    with pytest.raises(QatpipeError, match="none.json: cannot read the baseline metrics"):
        read_baseline(tmp_path / "none.json")


def test_deepstream_config_for_the_validated_model(engines, tmp_path):
    from qatpipe.deploy.deepstream import write_nvinfer_config

    spec, built = engines
    path = write_nvinfer_config(spec, built["qat"][0], tmp_path / "ds", "qat")
    assert path.name == "config_infer_primary_qat.txt"
    text = path.read_text()
    values = dict(line.split("=", 1) for line in text.splitlines() if "=" in line and not line.startswith("#"))
    # relative paths: the folder is registered as it is; the model is in nvinfer's built-in parser's layout
    assert values["onnx-file"] == f"{built['qat'][0].stem}_deepstream.onnx"
    assert (tmp_path / "ds" / values["onnx-file"]).is_file() and "parse-bbox-func-name" not in text
    assert values["network-mode"] == "1"  # INT8
    assert values["output-blob-names"] == "output_cov/Sigmoid;output_bbox/BiasAdd"  # TAO's names
    assert values["num-detected-classes"] == "3" and values["infer-dims"] == "3;192;320"
    assert (tmp_path / "ds" / "labels.txt").read_text().split() == ["car", "pedestrian", "cyclist"]
    # the parser's own lines come from the architecture's nvinfer layout; an architecture without one is refused
    from types import SimpleNamespace

    from qatpipe.models import DetectorArchitecture, get_architecture

    layout = get_architecture(spec).nvinfer_layout()
    assert values["cluster-mode"] == "2" and values["topk"] == str(spec.model.decoder.max_detections)
    assert set(layout.properties()) | set(layout.class_attributes()) <= set(text.splitlines())
    with pytest.raises(QatpipeError, match="SimpleNamespace: no DeepStream nvinfer layout"):
        DetectorArchitecture.nvinfer_layout(SimpleNamespace())


def test_deepstream_model_decodes_to_the_same_boxes_with_nvinfers_parser(engines, tmp_path):
    """nvinfer's built-in DetectNet_v2 decoding (nvinfer_boxes, written from its parser) of the DeepStream
    ONNX gives the boxes qatpipe's decoder reads from the exported model, for every cell and class."""
    import onnxruntime as ort

    from qatpipe.boxes import cell_boxes
    from qatpipe.deploy.deepstream import write_nvinfer_config
    from qatpipe.models.detectnet_v2_deepstream import nvinfer_boxes
    from qatpipe.models.detectnet_v2 import OUTPUT_STRIDE

    spec, built = engines
    write_nvinfer_config(spec, built["qat"][0], tmp_path / "ds", "qat")
    size = spec.dataset.image_size
    batch = np.random.default_rng(0).uniform(size=(2, size.height, size.width, 3)).astype(np.float32)

    def outputs(path):
        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        names = [o.name for o in session.get_outputs()]
        return dict(zip(names, session.run(None, {session.get_inputs()[0].name: batch})))

    ours = outputs(built["qat"][0])
    theirs = outputs(tmp_path / "ds" / f"{built['qat'][0].stem}_deepstream.onnx")
    assert set(theirs) == {"output_cov/Sigmoid", "output_bbox/BiasAdd"}
    norm, stride = spec.model.target.bbox_norm, OUTPUT_STRIDE
    for i in range(len(batch)):
        np.testing.assert_array_equal(theirs["output_cov/Sigmoid"][i], ours["output_cov"][i].transpose(2, 0, 1))
        boxes, scores, classes = nvinfer_boxes(theirs["output_cov/Sigmoid"][i], theirs["output_bbox/BiasAdd"][i],
                                               (size.height, size.width), threshold=0.0)
        # qatpipe's decoding of the same cells (decode_detectnet's, before clustering)
        cov, bbox = ours["output_cov"][i], ours["output_bbox"][i]
        expected = [cell_boxes(bbox, *np.nonzero(cov[:, :, c] >= 0.0), c, stride, norm)
                    for c in range(cov.shape[2])]
        expected = np.clip(np.concatenate(expected), 0, [size.width - 1, size.height - 1] * 2)
        assert len(boxes) == cov.size
        np.testing.assert_allclose(boxes, expected, atol=1e-3)


@needs_tensorrt
def test_tensorrt_builds_a_strongly_typed_int8_engine_that_matches_onnx_runtime(engines, tmp_path):
    from qatpipe.stages.evaluate import evaluate

    spec, built = engines
    qat_onnx, ort_engine = built["qat_exact"]  # TensorRT's numbers
    info = build_engine(spec, qat_onnx, tmp_path / "trt", backend="tensorrt")
    assert info["precision"].startswith("int8") and (tmp_path / "trt" / "timing.cache").is_file()
    ours, reference = evaluate(spec, tmp_path / "trt", tmp_path / "e1"), evaluate(spec, ort_engine, tmp_path / "e2")
    assert ours["map50"] == pytest.approx(reference["map50"], abs=0.01)


@needs_tensorrt
def test_tensorrt_engine_refuses_another_gpu_or_version(engines, tmp_path):
    spec, built = engines
    build_engine(spec, built["fp32"][0], tmp_path / "trt", backend="tensorrt")
    metadata = json.loads((tmp_path / "trt" / "engine.json").read_text())
    metadata["runtime_version"] = "9.9.9"
    (tmp_path / "trt" / "engine.json").write_text(json.dumps(metadata))
    with pytest.raises(ModelFileError, match="engine built with TensorRT 9.9.9 .* rebuild it here"):
        load_engine(tmp_path / "trt")


def _qdq_graph(nodes, initializers, outputs=("y",)):
    """A small hand-built ONNX model (input x: 1x2x4x4 float)."""
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, 4, 4])],
        [helper.make_tensor_value_info(name, TensorProto.FLOAT, [1, 2, 4, 4]) for name in outputs],
        [numpy_helper.from_array(np.asarray(v), k) for k, v in initializers.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_merge_requantization_on_a_chain_of_three_and_keeps_relu_clips(tmp_path):
    from onnx import helper

    from qatpipe.graph.cpu_qdq import activations_to_uint8, merge_requantization

    scale = {f"s{i}": np.float32(0.05 * i) for i in (1, 2, 3)}
    zero = {"z": np.int8(0)}
    nodes = [helper.make_node("QuantizeLinear", ["x", "s1", "z"], ["q1"]),
             helper.make_node("DequantizeLinear", ["q1", "s1", "z"], ["d1"]),
             helper.make_node("Relu", ["d1"], ["r1"]),
             helper.make_node("QuantizeLinear", ["r1", "s2", "z"], ["q2"]),
             helper.make_node("DequantizeLinear", ["q2", "s2", "z"], ["d2"]),
             helper.make_node("QuantizeLinear", ["d2", "s3", "z"], ["q3"]),
             helper.make_node("DequantizeLinear", ["q3", "s3", "z"], ["y"])]
    model = _qdq_graph(nodes, {**scale, **zero})
    activations_to_uint8(model, zero_point_0_after_relu=True)
    merged = merge_requantization(model)
    onnx.checker.check_model(model)
    ops = [n.op_type for n in model.graph.node]
    # the ReLU chain merges (Q(s2) has zero point 0, so the clip at 0 survives); Q(s3) has zero point 128
    # (its input is no ReLU output), so merging it would lose that clip: it stays
    assert merged == 1 and ops == ["QuantizeLinear", "DequantizeLinear", "QuantizeLinear", "DequantizeLinear"]
    import onnxruntime as ort

    x = np.random.default_rng(0).normal(size=(1, 2, 4, 4)).astype(np.float32)
    y = ort.InferenceSession(model.SerializeToString()).run(None, {"x": x})[0]
    assert (y >= 0).all()  # the ReLU's clip is kept by the zero point


def test_fast_form_after_a_relu_saturates_where_tensorrt_does():
    """int8 saturates 127 steps above 0; the fast form's uint8 (zero point 0, so ORT absorbs the ReLU) keeps
    that point with 255 steps of 127/255 the scale. Saturating at 255 steps let activations the QAT model never
    saw through (the tiny pipeline's QAT engine lost 10 points mAP@0.5 to it)."""
    import onnxruntime as ort
    from onnx import helper

    from qatpipe.graph.cpu_qdq import activations_to_uint8

    nodes = [helper.make_node("Relu", ["x"], ["r"]),
             helper.make_node("QuantizeLinear", ["r", "s", "z"], ["q"]),
             helper.make_node("DequantizeLinear", ["q", "s", "z"], ["y"])]
    scale = 0.1
    model = _qdq_graph(nodes, {"s": np.float32(scale), "z": np.int8(0)})
    x = np.linspace(-20, 20, 32, dtype=np.float32).reshape(1, 2, 4, 4)
    tensorrt = ort.InferenceSession(model.SerializeToString()).run(None, {"x": x})[0]
    assert activations_to_uint8(model, zero_point_0_after_relu=True) == 1
    fast = ort.InferenceSession(model.SerializeToString()).run(None, {"x": x})[0]
    assert tensorrt.max() == pytest.approx(127 * scale) and fast.max() == pytest.approx(127 * scale)
    np.testing.assert_allclose(fast, tensorrt, atol=scale / 2 + 1e-6)  # within half a TensorRT step
    assert (fast >= 0).all()


def test_fold_batch_norm_skips_what_it_cannot_fold_exactly():
    from onnx import helper

    from qatpipe.graph.cpu_qdq import fold_batch_norms

    w = np.ones((2, 2, 1, 1), np.int8)
    inits = {"xs": np.float32(0.1), "xz": np.int8(0), "w": w, "ws": np.float32(0.2), "wz": np.int8(0),
             "g": np.array([1.0, 0.0], np.float32), "b": np.zeros(2, np.float32), "m": np.zeros(2, np.float32),
             "v": np.ones(2, np.float32)}
    nodes = [helper.make_node("QuantizeLinear", ["x", "xs", "xz"], ["xq"]),
             helper.make_node("DequantizeLinear", ["xq", "xs", "xz"], ["xd"]),
             helper.make_node("DequantizeLinear", ["w", "ws", "wz"], ["wd"]),
             helper.make_node("Conv", ["xd", "wd"], ["c"]),
             helper.make_node("BatchNormalization", ["c", "g", "b", "m", "v"], ["y"])]
    # a per-tensor weight scale (TensorRT wants per channel) and a dead channel (gamma 0): left as they are
    assert fold_batch_norms(_qdq_graph(nodes, inits)) == 0


def test_the_fast_form_can_leave_out_a_speed_rewrite_and_refuses_a_needed_one():
    """bench/engines.py --without times what each of the fast form's optional rewrites buys."""
    from onnx import helper

    from qatpipe.graph.cpu_qdq import to_cpu_form

    def chain():  # Q -> DQ -> ReLU -> Q -> DQ: a requantization the fast form merges into one Q
        nodes = [helper.make_node("QuantizeLinear", ["x", "s1", "z"], ["q1"]),
                 helper.make_node("DequantizeLinear", ["q1", "s1", "z"], ["d1"]),
                 helper.make_node("Relu", ["d1"], ["r1"]),
                 helper.make_node("QuantizeLinear", ["r1", "s2", "z"], ["q2"]),
                 helper.make_node("DequantizeLinear", ["q2", "s2", "z"], ["y"])]
        return _qdq_graph(nodes, {"s1": np.float32(0.05), "s2": np.float32(0.1), "z": np.int8(0)})

    assert to_cpu_form(chain(), "fast")["requantizations_merged"] == 1
    kept = chain()
    assert to_cpu_form(kept, "fast", without=frozenset({"requantizations_merged"}))["requantizations_merged"] == 0
    assert [n.op_type for n in kept.graph.node].count("QuantizeLinear") == 2
    with pytest.raises(ValueError, match="batch_norms_folded"):
        to_cpu_form(chain(), "fast", without=frozenset({"batch_norms_folded"}))
