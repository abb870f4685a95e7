"""Stage: export a trained detector to ONNX (TAO `export`), checked against TensorFlow in ONNX Runtime.

An FP32 model becomes a plain ONNX. A QAT model becomes an explicit-quantization ONNX (int8 weights, Q/DQ
checked against TensorRT's rules) plus, for TensorRT <= 10 / DeepStream, its implicit-INT8 pair: the FP32
graph `<stem>_implicit.onnx` with the QAT weights, and the activation scales as a TAO calibration cache
`<stem>.cache` and as `<stem>_scales.json` (the names: export/bundle.py).
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path

import numpy as np

from qatpipe.errors import QatpipeError
from qatpipe.export.bundle import ExportBundle
from qatpipe.fileio import atomic_write_text, write_json
from qatpipe.spec import ExperimentSpec
from qatpipe.tracking.records import StageRecord

log = logging.getLogger(__name__)

# FP32 TensorFlow vs ONNX Runtime: the same maths in another order; anything larger is a conversion bug
FP32_TOLERANCE = 1e-3
# QAT, end to end: the frameworks round values on an int8 boundary apart and later layers carry the flips, so
# the limits are int8 steps of each output (docs/quantization.md, "TensorFlow vs ONNX Runtime", has the figures)
QAT_TOLERANCE_STEPS = {"p90_steps": 1.0, "p99_steps": 4.0}
# deeper networks carry the flips further: each limit is at least SENSITIVITY_MARGIN x the TensorFlow model's own
# movement when its input moves by ROUNDING_PERTURBATION (export_onnx.rounding_sensitivity)
ROUNDING_PERTURBATION = 1e-6
SENSITIVITY_MARGIN = 2.0
# Those limits only warn: the layer-local check (export/layer_check.py) decides a QAT export, and they decide only
# where some layer with ONNX nodes could not be checked.


def qat_limits(sensitivity: dict[str, dict]) -> dict[str, dict[str, float]]:
    """Per output, the largest ONNX-vs-TensorFlow difference (in int8 steps) a correct QAT export may show."""
    return {name: {key: round(max(limit, SENSITIVITY_MARGIN * figures[key]), 4)
                   for key, limit in QAT_TOLERANCE_STEPS.items()}
            for name, figures in sensitivity.items()}


def export(spec: ExperimentSpec, model_path: str | Path, output_path: str | Path, stage_name: str = "export") -> dict:
    """Write `output_path` (.onnx, dynamic batch) and `<stem>_export.json` beside it (QAT: also the
    calibration cache pair, and a tracking.json for the pipeline); fail if ONNX Runtime disagrees with
    TensorFlow on sample inputs."""
    from qatpipe.export.onnx_export import (export_onnx, output_differences, rounding_sensitivity, tf_outputs,
                                            write_decoding)
    from qatpipe.models import get_architecture
    from qatpipe.models.io import load_keras_model
    from qatpipe.quantization.layers import is_quantized_model

    output_path = Path(output_path)
    bundle = ExportBundle(output_path)
    if output_path.suffix.lower() != ".onnx":
        raise QatpipeError(f"{output_path}: the export target must end in .onnx")
    arch = get_architecture(spec)
    model = load_keras_model(model_path, arch)
    qat = is_quantized_model(model)
    export_onnx(model, output_path, spec.export.opset)
    metadata = write_decoding(output_path, arch.decoding())  # for the engine backends (models/decoding.py)
    report = {"model": str(model_path), "onnx": str(output_path), "opset": spec.export.opset,
              "quantization": "explicit int8 (QAT)" if qat else "none (FP32)", "metadata": sorted(metadata)}
    if qat:
        report.update(_finish_qat_export(spec, output_path))
    elif spec.export.target == "dla":
        log.warning("export.target dla: the DLA form is written for the QAT model only; %s is not one", model_path)
    report["size_mb"] = round(output_path.stat().st_size / 2**20, 3)
    # inputs in the model's range ([0, 1] pixels); two images exercise the dynamic batch
    sample = np.random.default_rng(0).uniform(size=(2, *model.input_shape[1:])).astype(np.float32)
    reference = tf_outputs(model, sample)
    differences = output_differences(model, output_path, sample, reference)
    report["difference_vs_tensorflow"] = differences
    limits, layers_decide = {}, False
    if qat:
        report["tensorflow_rounding_sensitivity"] = rounding_sensitivity(model, sample, ROUNDING_PERTURBATION,
                                                                         reference=reference)
        limits = report["difference_limits"] = qat_limits(report["tensorflow_rounding_sensitivity"])
        report["layer_check"] = _layer_check(model, output_path, sample)
        layers_decide = not report["layer_check"]["unchecked"]
    report_path = write_json(bundle.report, report)
    if qat and report["layer_check"]["failed"]:
        failed = report["layer_check"]["failed"]
        raise QatpipeError(
            f"{output_path}: ONNX Runtime differs from TensorFlow at {len(failed)} layer(s) fed the same input: "
            + "; ".join(f"{name} ({f['kind']}: {f['problem']})" if "problem" in f else
                        f"{name} ({f['kind']}: max {f['max_steps']:.2f}, 90th percentile {f['p90_steps']:.2f} int8 "
                        f"steps of its output)" for name, f in list(failed.items())[:5])
            + f"; the export is wrong there, see {bundle.report.name}")
    for name, d in differences.items():
        too_far = (any(d[key] > limit for key, limit in limits[name].items()) if qat
                   else d["max_abs"] > FP32_TOLERANCE)
        if too_far and layers_decide:
            log.warning("%s: ONNX Runtime's %s differs from TensorFlow's by a 90th / 99th percentile of %.2f / %.2f "
                        "int8 steps (TensorFlow's own rounding sensitivity gives %.2f / %.2f), while every layer "
                        "agrees fed the same input: rounding flips accumulated over the depth", output_path, name,
                        d["p90_steps"], d["p99_steps"], limits[name]["p90_steps"], limits[name]["p99_steps"])
        elif too_far:
            raise QatpipeError(
                f"{output_path}: ONNX Runtime differs from TensorFlow on {name} (max {d['max_abs']:.2e}; 90th / "
                f"99th percentile {d['p90_steps']:.2f} / {d['p99_steps']:.2f} int8 steps, limits "
                f"{limits[name]['p90_steps']:.2f} / {limits[name]['p99_steps']:.2f}); the export is wrong, "
                f"see {bundle.report.name}")
    files = [output_path, report_path]
    if qat:
        files += [bundle.implicit, bundle.cache]
    if "dla" in report:
        files += [bundle.dla, bundle.dla_cache, bundle.dla_report, bundle.dla_report_markdown]
    if qat:
        files.append(bundle.scales)
    fp16_metrics = {}
    if spec.export.fp16_onnx:
        report["fp16"] = write_fp16_form(spec, output_path, qat)
        write_json(report_path, report)
        files += [Path(report["fp16"]["onnx"]), *(Path(p) for p in report["fp16"]["precision_report"])]
        fp16_metrics = {f"fp16.{key}": report["fp16"][key]
                        for key in ("fp16_nodes", "fp32_nodes", "guard_flags", "layer_max_error")}
    StageRecord(
        stage=stage_name, params={"export.opset": spec.export.opset, "quantization": report["quantization"],
                                  "export.fp16_onnx": spec.export.fp16_onnx},
        metrics={"size_mb": report["size_mb"], "int8_weights": report.get("int8_weights", 0),
                 **{f"{name}.max_abs_difference_vs_tf": d["max_abs"] for name, d in differences.items()},
                 **({"layer_check.layers": report["layer_check"]["checked"],
                     "layer_check.worst_max_steps": (report["layer_check"]["worst"] or {}).get("max_steps", 0.0)}
                    if qat else {}),
                 **fp16_metrics},
        artifacts=[path.name for path in files],
    ).write(output_path.parent)
    log.info("exported %s -> %s (opset %d, %.2f MB, %s; max |TF - ORT| %s)", model_path, output_path,
             spec.export.opset, report["size_mb"], report["quantization"],
             ", ".join(f"{k} {v['max_abs']:.1e}" for k, v in differences.items()))
    return report


def _layer_check(model, onnx_path: Path, sample: np.ndarray) -> dict:
    """export/layer_check.py's comparison of every layer, for the report: the layers checked, those beyond their
    limits, the closest to them, and the layers with ONNX nodes it could not check (why)."""
    import onnx

    from qatpipe.export.layer_check import NO_NODES, layer_differences

    result = layer_differences(model, onnx.load(onnx_path), sample)
    worst = result["worst"]
    log.info("layer check: %d layers agree with TensorFlow fed the same input%s; closest to its limits: %s (max "
             "%.3f int8 steps)", len(result["layers"]) - len(result["failed"]),
             f", {len(result['failed'])} do not" if result["failed"] else "", worst,
             result["layers"][worst]["max_steps"] if worst else 0.0)
    return {"checked": len(result["layers"]), "failed": {name: result["layers"][name] for name in result["failed"]},
            "worst": {"layer": worst, **result["layers"][worst]} if worst else None,
            "unchecked": {name: why for name, why in result["skipped"].items() if why != NO_NODES},
            "layers": result["layers"]}


def write_fp16_form(spec: ExperimentSpec, output_path: Path, qat: bool) -> dict:
    """The export's FP16 form (ExportBundle.fp16): its float regions in FP16 (export/fp16.py), the tensors the FP16
    guard flags on `export.fp16_images` training images kept FP32; precision_report.json/.md beside it (the
    guard's ranges and flags, the FP16 form against the float32 one layer by layer). A Q/DQ model's FP16 form
    must still pass TensorRT's rule check."""
    import onnx

    from qatpipe.data.pipeline import eval_dataset
    from qatpipe.data.splits import sample_split
    from qatpipe.export import fp16
    from qatpipe.export.onnx_export import save_onnx
    from qatpipe.export.precision import compare_layers, precision_report, write_report
    from qatpipe.export.qdq import check_explicit_quantization

    samples = sample_split(spec, "train", spec.export.fp16_images, seed=0)
    batches = [batch.numpy() for batch in eval_dataset(samples, spec)]
    report = precision_report(output_path, batches)
    flags = {flag["name"]: flag["why"] for flag in report["fp16_flags"]}
    model16, plan = fp16.convert(onnx.load(output_path), flags)
    if qat:
        check = check_explicit_quantization(model16)
        if check.problems:
            raise QatpipeError(f"{output_path}: its FP16 form breaks TensorRT's Q/DQ rules: "
                               f"{'; '.join(check.problems[:5])}")
    fp16_path = save_onnx(model16, ExportBundle(output_path).fp16)
    with tempfile.TemporaryDirectory() as scratch:  # scored as fp16.rounded_form: FP16 values as FP16 holds them
        rounded = save_onnx(fp16.rounded_form(onnx.load(output_path), model16), Path(scratch) / "rounded.onnx")
        report["layers"] = compare_layers(output_path, rounded, batches)
    report["fp16_form"] = plan.to_dict()
    written = write_report(report, output_path.parent)
    worst = report["layers"]["worst"]
    log.info("FP16 form %s: %d nodes FP16, %d FP32 (%d flagged by the guard); worst tensor %s, max error %.3g of "
             "its range", fp16_path.name, len(plan.fp16), len(plan.fp32), len(flags), worst["tensor"],
             worst["max_error"])
    return {"onnx": str(fp16_path), "fp16_nodes": len(plan.fp16), "fp32_nodes": len(plan.fp32),
            "guard_flags": len(flags), "casts": plan.casts, "layer_max_error": worst["max_error"],
            "precision_report": [str(path) for path in written]}


def _finish_qat_export(spec: ExperimentSpec, output_path: Path) -> dict:
    """int8 weights and the TensorRT rule check on the explicit model; the implicit pair beside it."""
    import onnx

    from qatpipe.export.onnx_export import save_onnx
    from qatpipe.export.qdq import (calibration_cache_text, check_explicit_quantization,
                                    fold_weight_quantizers, strip_qdq, write_scales_json)

    model = onnx.load(output_path)
    folded = fold_weight_quantizers(model)
    check = check_explicit_quantization(model)
    if check.problems:
        raise QatpipeError(f"{output_path}: the Q/DQ graph breaks TensorRT's rules: {'; '.join(check.problems)}")
    save_onnx(model, output_path)
    scales = strip_qdq(model)
    bundle = ExportBundle(output_path)
    implicit = save_onnx(model, bundle.implicit)
    cache = bundle.cache
    atomic_write_text(cache, calibration_cache_text(scales, spec.export.calibration_cache_trt_version))
    write_scales_json(bundle.scales, scales)
    dla = _write_dla_form(spec, output_path, implicit, scales) if spec.export.target == "dla" else None
    log.info("QAT ONNX: %d int8 weights, %d quantized Conv/Gemm, %d float, %d Add nodes with a quantized input; "
             "calibration cache %s (%d tensors)", folded, len(check.quantized), len(check.float_),
             len(check.residual_adds), cache, len(scales))
    return {"int8_weights": folded, "qdq_check": check.to_dict(), "implicit_onnx": str(implicit),
            "calibration_cache": str(cache), "calibration_tensors": len(scales), **({"dla": dla} if dla else {})}


def _write_dla_form(spec: ExperimentSpec, output_path: Path, implicit_onnx: Path, scales: dict[str, float]) -> dict:
    """export.target dla: the DLA form of the QAT model (its implicit graph and QAT `scales`) and its full-tensor
    calibration cache (export/dla.py), calibrated on `export.dla_calibration_images` training images; the
    report without its per-layer list."""
    from qatpipe.data.pipeline import eval_dataset
    from qatpipe.data.splits import sample_split
    from qatpipe.export.dla import write_dla_export

    samples = sample_split(spec, "train", spec.export.dla_calibration_images, seed=0)
    report = write_dla_export(output_path, implicit_onnx, scales,
                              (batch.numpy() for batch in eval_dataset(samples, spec)), spec.export.dla_batch,
                              spec.export.calibration_cache_trt_version, len(samples),
                              spec.export.dla_calibration_method)
    return {key: value for key, value in report.items() if key != "placement"}


__all__ = ["export", "write_fp16_form"]
