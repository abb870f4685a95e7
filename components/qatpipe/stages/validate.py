"""Stage: validate a deployable engine: its mAP on the val set, by running it, against the FP32 baseline, and
the gate `validate.max_map_drop` (TAO's last check before a model ships); a passing model gets its DeepStream
nvinfer config."""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path

from qatpipe.errors import QatpipeError
from qatpipe.export.bundle import ExportBundle
from qatpipe.export.precision import MARKDOWN_FILE as PRECISION_MARKDOWN
from qatpipe.fileio import atomic_write_text, write_json
from qatpipe.spec import ExperimentSpec
from qatpipe.tracking.records import StageRecord

log = logging.getLogger(__name__)

REPORT_FILE = "validation.json"
MARKDOWN_FILE = "validation.md"
EMULATED_FOLDER = "tensorrt_emulated"  # the exact CPU form of a fast engine, and its evaluation
FP16_ROUNDED_FILE = "fp16_rounded.onnx"  # in EMULATED_FOLDER: the FP16 form as ONNX Runtime's CPU build scores it
DLA_EMULATED_FOLDER = "dla_emulated"  # export.target dla: the DLA form, INT8 on every tensor, and its evaluation
FP16_REPORT_FILE = "fp16_precision_report.md"  # the export's FP16 precision report, beside the verdict
DEEPSTREAM_FOLDER = "deepstream"  # a passing model's nvinfer config, labels and DeepStream-layout ONNX


def read_baseline(path: str | Path) -> dict:
    path = Path(path)
    try:
        baseline = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise QatpipeError(f"{path}: cannot read the baseline metrics: {exc}") from None
    if not isinstance(baseline, dict) or "map50" not in baseline:
        raise QatpipeError(f"{path}: not an evaluation metrics.json (no map50)")
    return baseline


def gate(map50: float, baseline_map50: float, max_drop: float) -> tuple[bool, float]:
    """(passed, drop): the drop is baseline - engine in mAP@0.5 (negative: the engine is better)."""
    drop = round(baseline_map50 - map50, 6)
    return within(drop, max_drop), drop


def within(drop: float, max_drop: float) -> bool:
    """Whether an mAP drop is one the gate allows (float rounding of the two mAPs forgiven)."""
    return drop <= max_drop + 1e-12


def tensorrt_emulated_map50(spec: ExperimentSpec, engine_dir: Path, output_dir: Path,
                            onnx_model: str | Path | None = None, variant: str | None = None,
                            same_as: Path | None = None) -> tuple[float | None, str]:
    """(mAP@0.5 of TensorRT's numbers, how it was had), or (None, why there is nothing to emulate).

    TensorRT builds what its backend's `source` picks (tensorrt_source): under `engine.fp16` the export's FP16
    form (float regions FP16 through casts), else the ONNX itself. A TensorRT engine gives its own mAP. An ONNX
    Runtime engine computes TensorRT's numbers itself only when it runs the same graph the same way: a float
    engine without an FP16 form, or a Q/DQ engine not in the `fast` CPU form (engine.json's `cpu_form`) without
    one.
    Otherwise the source ONNX (`onnx_model`, else the one engine.json names, checked by its SHA-256) is scored
    as TensorRT would run it, into output_dir/tensorrt_emulated: its FP16 form with every FP16 value rounded
    as FP16 holds it (export/fp16.py `rounded_form`), in ONNX Runtime's exact CPU form. `same_as`: another
    validation's folder, whose emulated scores are taken when they scored the same model (evaluate's same_as)."""
    from qatpipe.engines.base import EngineMetadata
    from qatpipe.fileio import file_sha256

    metadata = EngineMetadata.read(engine_dir)
    if metadata.backend == "tensorrt":
        return None, "the engine computes TensorRT's numbers itself"
    source = Path(onnx_model) if onnx_model else Path(metadata.source_onnx)
    fp16_form = ExportBundle(source).fp16 if tensorrt_builds_fp16_form(spec, source) else source
    if fp16_form == source and metadata.cpu_form != "fast":
        return None, ("the engine computes TensorRT's numbers itself" if metadata.compute_precision == "int8"
                      else f"a {metadata.compute_precision} engine without an FP16 form (engine.fp16: "
                           f"{spec.engine.fp16}): no quantization to emulate")
    if not source.is_file():
        raise QatpipeError(f"{engine_dir}: its source ONNX {source} is not here, and the TensorRT-emulated mAP "
                           "needs it: pass the model the engine was built from")
    if file_sha256(source) != metadata.source_sha256:
        raise QatpipeError(f"{source}: not the ONNX model {engine_dir} was built from (SHA-256 differs from "
                           "engine.json's source_sha256)")
    folder = output_dir / EMULATED_FOLDER
    scored, how = source, "the source ONNX in ONNX Runtime's exact CPU form"
    if fp16_form != source:
        import onnx

        from qatpipe.export.fp16 import rounded_form
        from qatpipe.export.onnx_export import save_onnx

        folder.mkdir(parents=True, exist_ok=True)
        scored = save_onnx(rounded_form(onnx.load(source), onnx.load(fp16_form)), folder / FP16_ROUNDED_FILE)
        how = (f"its FP16 form {fp16_form.name} (engine.fp16: what TensorRT builds), FP16 values rounded as FP16 "
               "holds them, in ONNX Runtime's exact CPU form")
    return (exact_form_map50(spec, scored, folder, "tensorrt_emulated", _labelled(variant, "TensorRT's numbers"),
                             same_as / EMULATED_FOLDER if same_as else None), f"{how} ({EMULATED_FOLDER}/)")


def tensorrt_builds_fp16_form(spec: ExperimentSpec, source: Path) -> bool:
    """Whether TensorRT builds the FP16 form of the export `source` (its backend's `source` choice), so that
    TensorRT's numbers are that form's."""
    from qatpipe.engines.tensorrt_backend import TensorRTBackend

    bundle = ExportBundle(source)
    return TensorRTBackend.source(bundle, spec.engine) == bundle.fp16


def _labelled(variant: str | None, what: str) -> str | None:
    """How an emulated evaluation of `variant` names itself in its report and PR curves."""
    return f"{variant}, {what} (emulated)" if variant else None


def exact_form_map50(spec: ExperimentSpec, onnx_model: Path, folder: Path, name: str,
                     variant: str | None = None, same_as: Path | None = None) -> float:
    """mAP@0.5 of `onnx_model` as an ONNX Runtime engine in the exact CPU form (a Q/DQ model's numbers as
    TensorRT computes them), built in folder/engine and evaluated into `folder` (stages build_<name>,
    validate_<name>; its report and PR curves name `variant`, default `name`; evaluate's `same_as`)."""
    from qatpipe.stages.build_engine import build_engine
    from qatpipe.stages.evaluate import evaluate

    exact = spec.model_copy(deep=True)
    exact.engine.cpu_form = "exact"
    build_engine(exact, onnx_model, folder / "engine", backend="onnxruntime", stage_name=f"build_{name}")
    return evaluate(exact, folder / "engine", folder, stage_name=f"validate_{name}", variant=variant or name,
                    same_as=same_as)["map50"]


def _quantized_by(onnx_path: Path) -> str | None:
    """What quantized a PTQ model (its QUANTIZED_BY_KEY metadata), None for other models or without the ONNX."""
    from qatpipe.onnx_model import QUANTIZED_BY_KEY, load_onnx_proto

    if not onnx_path.is_file():
        return None
    return {prop.key: prop.value for prop in load_onnx_proto(onnx_path).metadata_props}.get(QUANTIZED_BY_KEY)


def dla_emulated_map50(spec: ExperimentSpec, source: Path, output_dir: Path, variant: str | None = None,
                       same_as: Path | None = None) -> tuple[float | None, str]:
    """(mAP@0.5 of the export's DLA form as DLA's INT8 computes it, how), or (None, why not) without one.

    The DLA form's graph is the export's implicit FP32 ONNX (`<stem>_implicit.onnx`) with a fixed batch; its
    calibration cache gives every tensor a scale, and a DLA layer computes INT8 on each. So the implicit graph
    with a symmetric int8 Q/DQ on every cached tensor (export/dla.py `fake_quantized`), in ONNX Runtime's exact
    CPU form, scores what the Orin DLA engine will, up to the layers TensorRT leaves to the GPU or FP16."""
    import onnx

    from qatpipe.export.dla import fake_quantized
    from qatpipe.export.onnx_export import save_onnx
    from qatpipe.export.qdq import read_calibration_cache

    bundle = ExportBundle(source)
    dla_onnx, cache, implicit = bundle.dla, bundle.dla_cache, bundle.implicit
    if not (dla_onnx.is_file() and cache.is_file()):
        return None, "no DLA form beside the ONNX (export.target: gpu)"
    if not implicit.is_file():
        raise QatpipeError(f"{source}: the DLA form needs its implicit FP32 graph {implicit.name} beside it to be "
                           "scored")
    _, scales = read_calibration_cache(cache.read_text())
    folder = output_dir / DLA_EMULATED_FOLDER
    folder.mkdir(parents=True, exist_ok=True)
    scored = save_onnx(fake_quantized(onnx.load(implicit), scales), folder / "model.onnx")
    how = (f"{implicit.name} with an int8 Q/DQ on each of the {len(scales)} tensors of {cache.name}, in ONNX "
           f"Runtime's exact CPU form ({DLA_EMULATED_FOLDER}/)")
    return exact_form_map50(spec, scored, folder, "dla_emulated", _labelled(variant, "Orin DLA's INT8"),
                            same_as / DLA_EMULATED_FOLDER if same_as else None), how


def validate(spec: ExperimentSpec, engine_dir: str | Path, baseline_metrics: str | Path,
             output_dir: str | Path | None = None, variant: str = "int8",
             onnx_model: str | Path | None = None, same_as: str | Path | None = None) -> dict:
    """Evaluate the engine, and TensorRT's numbers too where the engine does not compute them itself
    (`map50_tensorrt_emulated`: what the model will score on TensorRT, where the engine here runs a faster CPU
    form or float32 in place of the FP16 form; tensorrt_emulated_map50); compare both with the baseline; write
    validation.json / .md, a copy of the engine's bench.json when it has one, and for a passing model the
    DeepStream config (deepstream/, from `onnx_model`, else the engine's source ONNX). The gate passes only
    when both are within validate.max_map_drop. Never raises on a failed gate (the result says `passed`: the
    caller decides, the CLI exits non-zero). `same_as`: another validation's folder (of a variant that may be
    the same model, as ptq-partial keeping no layer float is PTQ): its scores are taken wherever they scored the
    same model bytes on the same images (evaluate's same_as), and the model runs wherever they did not."""
    from qatpipe.engines.base import EngineMetadata
    from qatpipe.stages.bench_engine import BENCH_FILE
    from qatpipe.stages.evaluate import evaluate

    engine_dir = Path(engine_dir)
    baseline = read_baseline(baseline_metrics)
    output_dir = Path(output_dir) if output_dir else engine_dir / "validate"
    metadata = EngineMetadata.read(engine_dir)
    label = metadata.label
    # the record is validate_<variant>, "-" as "_" (validate_ptq_partial), as every stage record is named
    same_as = Path(same_as) if same_as else None
    evaluation = evaluate(spec, engine_dir, output_dir, stage_name=f"validate_{variant.replace('-', '_')}",
                          variant=variant, same_as=same_as)
    source = Path(onnx_model) if onnx_model else Path(metadata.source_onnx)  # the ONNX the engine was built from
    emulated, emulation = tensorrt_emulated_map50(spec, engine_dir, output_dir, source, variant, same_as)
    dla, dla_how = dla_emulated_map50(spec, source, output_dir, variant, same_as)
    max_drop = spec.validate_.max_map_drop
    passed, drop = gate(evaluation["map50"], baseline["map50"], max_drop)
    report = {
        "variant": variant, "engine": str(engine_dir), "engine_label": label, "map50": evaluation["map50"],
        "map": evaluation["map"], "baseline": str(baseline_metrics), "baseline_map50": baseline["map50"],
        "baseline_map": baseline.get("map"), "map50_drop": drop, "max_map_drop": max_drop,
        "engine_size_mb": evaluation["model_size_mb"], "tensorrt_emulation": emulation,
        # an INT8 engine in the exact CPU form, or a TensorRT one: its own mAP is TensorRT's numbers
        "computes_tensorrt_numbers": emulated is None and (metadata.backend == "tensorrt"
                                                           or metadata.compute_precision == "int8"),
        "layer_precision": metadata.layer_precision,  # compute layers per precision, as the engine's ONNX asks
        "quantized_by": _quantized_by(source),  # a PTQ model's tool, version and method
    }
    fp16_report = None
    if emulated is not None:
        emulated_passed, emulated_drop = gate(emulated, baseline["map50"], max_drop)
        report.update(map50_tensorrt_emulated=emulated, map50_tensorrt_emulated_drop=emulated_drop)
        passed = passed and emulated_passed
        if tensorrt_builds_fp16_form(spec, source):
            report["fp16_form"] = True  # TensorRT's numbers are the FP16 form's
            fp16_report = _fp16_precision_report(source, output_dir)
    if dla is not None:  # export.target dla: the Orin DLA engine's numbers gate too
        dla_passed, dla_drop = gate(dla, baseline["map50"], max_drop)
        report.update(map50_dla_emulated=dla, map50_dla_emulated_drop=dla_drop, dla_emulation=dla_how)
        passed = passed and dla_passed
    report["passed"] = passed
    artifacts = [REPORT_FILE, MARKDOWN_FILE]
    if fp16_report:
        report["fp16_precision_report"] = FP16_REPORT_FILE
        artifacts.append(FP16_REPORT_FILE)
    if (engine_dir / BENCH_FILE).is_file():  # the engine's benchmark travels with its verdict (compare reads it)
        shutil.copyfile(engine_dir / BENCH_FILE, output_dir / BENCH_FILE)
        report["benchmark"] = json.loads((output_dir / BENCH_FILE).read_text())
        artifacts.append(BENCH_FILE)
    if passed and _deepstream_config(spec, metadata, source, output_dir, variant):
        artifacts.append(DEEPSTREAM_FOLDER)
    write_json(output_dir / REPORT_FILE, report)
    verdict = "PASSED" if passed else "FAILED"
    rows = [f"| {variant} ({label}) | {evaluation['map50']:.4f} | {evaluation['map']:.4f} | {100 * drop:+.2f} |"]
    if emulated is not None:
        rows.append(f"| {variant}, TensorRT's numbers (emulated) | {emulated:.4f} | | "
                    f"{100 * report['map50_tensorrt_emulated_drop']:+.2f} |")
    if dla is not None:
        rows.append(f"| {variant}, Orin DLA's INT8 (emulated) | {dla:.4f} | | {100 * dla_drop:+.2f} |")
    atomic_write_text(output_dir / MARKDOWN_FILE, "\n".join([
        f"# Validation of {variant}: {verdict}", "",
        "| | mAP@0.5 | mAP@[.5:.95] | mAP@0.5 drop (points) |", "|---|---|---|---|", *rows,
        f"| baseline | {baseline['map50']:.4f} | {baseline.get('map', float('nan')):.4f} | |", "",
        f"Allowed drop {100 * max_drop:.2f} points (validate.max_map_drop); TensorRT-emulated mAP: {emulation}.",
        *([f"DLA-emulated mAP: {dla_how}."] if dla is not None else []),
        "", *_fp16_section(report, fp16_report)]))
    record = StageRecord.read(output_dir)
    record.params["engine"] = label
    record.metrics.update({"map50_drop": drop, "passed": float(passed)})
    if emulated is not None:
        record.metrics.update({"map50_tensorrt_emulated": emulated,
                               "map50_tensorrt_emulated_drop": report["map50_tensorrt_emulated_drop"]})
    if dla is not None:
        record.metrics.update({"map50_dla_emulated": dla, "map50_dla_emulated_drop": dla_drop})
    record.artifacts.extend(artifacts)
    record.write(output_dir)
    if not passed:
        log.warning("%s", gate_message(report))
    log.info("validation of %s (%s): %s (mAP@0.5 %.4f%s vs baseline %.4f, allowed drop %.2f points)", variant,
             label, verdict, evaluation["map50"],
             "" if emulated is None else f", TensorRT-emulated {emulated:.4f}", baseline["map50"], 100 * max_drop)
    return report


def _fp16_precision_report(onnx_model: Path, output_dir: Path) -> str | None:
    """The export's precision report of the FP16 form (beside its ONNX), copied into the validation as
    FP16_REPORT_FILE; its Markdown, or None (with a warning) when the export wrote none."""
    report = onnx_model.with_name(PRECISION_MARKDOWN)
    if not report.is_file():
        log.warning("no FP16 precision report beside %s: the validation cannot say where FP16 loses accuracy",
                    onnx_model)
        return None
    text = report.read_text(encoding="utf-8")
    atomic_write_text(output_dir / FP16_REPORT_FILE, text)
    return text


def _fp16_section(report: dict, fp16_report: str | None) -> list[str]:
    """validation.md's lines on the FP16 form: where to look, and the whole precision report when TensorRT's
    numbers (the FP16 form's) fail the gate."""
    if not report.get("fp16_form"):
        return []
    if within(report["map50_tensorrt_emulated_drop"], report["max_map_drop"]):
        return [f"TensorRT's numbers are the FP16 form's; its precision report: {FP16_REPORT_FILE}.", ""]
    lines = ["## Why: the FP16 form loses accuracy", "",
             "TensorRT's numbers are the FP16 form's (engine.fp16). Its precision report from the export (the "
             "tensors FP16 would overflow or zero, and the layer-by-layer error) follows: keep the named tensors "
             "in FP32, or set engine.fp16 false.", ""]
    body = re.sub(r"(?m)^# ", "### ", fp16_report or "(no precision report beside the ONNX)")  # under this section
    return [*lines, body, ""]


def _deepstream_config(spec: ExperimentSpec, metadata, source: Path, output_dir: Path, variant: str) -> bool:
    """The nvinfer config of a passing model, in the network mode of what the engine is (engine.json's
    compute_precision, not the variant's name); False, with a warning, when its ONNX is not here."""
    from qatpipe.deploy.deepstream import write_nvinfer_config

    if not source.is_file():
        log.warning("no DeepStream config for %s: its ONNX %s is not here (pass the model the engine was built "
                    "from)", variant, source)
        return False
    network_mode = "int8" if metadata.compute_precision == "int8" else "fp16"
    write_nvinfer_config(spec, source, output_dir / DEEPSTREAM_FOLDER, variant, network_mode)
    bundle = ExportBundle(source)
    dla_onnx, dla_cache = bundle.dla, bundle.dla_cache
    if dla_onnx.is_file() and dla_cache.is_file():  # export.target dla: a second config, for Orin's DLA
        write_nvinfer_config(spec, dla_onnx, output_dir / DEEPSTREAM_FOLDER, f"{variant}_dla", "int8",
                             calibration_cache=dla_cache, dla_core=spec.engine.dla_core)
    return True


def gate_message(report: dict) -> str:
    emulated = "TensorRT-emulated mAP@0.5" + (f" (the FP16 form; {FP16_REPORT_FILE} says where it loses)"
                                             if report.get("fp16_form") else "")
    failures = [f"{what} {report[key]:.4f} is {100 * report[f'{key}_drop']:.2f} points below"
                for key, what in (("map50", "mAP@0.5"), ("map50_tensorrt_emulated", emulated),
                                  ("map50_dla_emulated", "DLA-emulated mAP@0.5 (INT8 on every tensor)"))
                if key in report and not within(report[f"{key}_drop"], report["max_map_drop"])]
    return (f"validation gate failed for {report['variant']}: {'; '.join(failures)} the baseline "
            f"{report['baseline_map50']:.4f}, more than validate.max_map_drop={report['max_map_drop']} "
            f"({100 * report['max_map_drop']:.2f} points) allows")


__all__ = ["validate", "gate", "gate_message", "read_baseline", "tensorrt_emulated_map50", "dla_emulated_map50",
           "exact_form_map50",
           "REPORT_FILE", "MARKDOWN_FILE", "EMULATED_FOLDER", "DLA_EMULATED_FOLDER", "DEEPSTREAM_FOLDER"]
