"""Stage: the ptq-partial variant: the PTQ model with its most sensitive layers kept float, until it scores within
validate.max_map_drop of FP32 (`ptq.keep_float: auto`), or with the layers `ptq.keep_float` names
(quantization/partial.py; docs/quantization.md)."""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
from pathlib import Path

from qatpipe.errors import QatpipeError
from qatpipe.fileio import write_json
from qatpipe.spec import ExperimentSpec
from qatpipe.tracking.records import StageRecord

log = logging.getLogger(__name__)

REPORT_FILE = "ptq_partial.json"


def _ranking(sensitivity_dir: Path | None) -> list[str]:
    from qatpipe.quantization.partial import ranking
    from qatpipe.stages.sensitivity import JSON_FILE

    if sensitivity_dir is None:
        raise QatpipeError("ptq.keep_float auto ranks the layers by the PTQ model's sensitivity: give its folder "
                           f"(the sensitivity stage's output, or `qatpipe sensitivity`'s, with {JSON_FILE})")
    path = Path(sensitivity_dir) / JSON_FILE
    try:
        return ranking(json.loads(path.read_text()))
    except FileNotFoundError:
        raise QatpipeError(f"{path}: no sensitivity report (run the sensitivity stage on the PTQ model)") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise QatpipeError(f"{path}: not a sensitivity report: {type(exc).__name__}: {exc}") from None


def _confirmation(spec: ExperimentSpec, arch, fp32_onnx: Path, folder: str, sampled: int):
    """The search's look at every val image (the images the gate scores), read as each model is scored; None
    where the sample is the whole val split already."""
    from qatpipe.data.splits import load_split
    from qatpipe.quantization.partial import Confirm
    from qatpipe.quantization.sensitivity import exact_scorer
    from qatpipe.stages.sensitivity import scorer

    samples = load_split(spec, "val")
    if len(samples) <= sampled:
        return None
    score_path, _, _ = scorer(spec, samples, arch, read_once=False)
    map50_fp32 = score_path(fp32_onnx)
    log.info("ptq-partial: FP32 mAP@0.5 %.4f on all %d val images; a model the sample puts within the budget is "
             "scored on them too", map50_fp32, len(samples))
    return Confirm(exact_scorer(score_path, folder), map50_fp32, len(samples))


def ptq_partial(spec: ExperimentSpec, fp32_onnx: str | Path, ptq_onnx: str | Path, output: str | Path,
                sensitivity_dir: str | Path | None = None) -> dict:
    """Write `output` (a Q/DQ .onnx: `ptq_onnx` with the layers spec.ptq.keep_float gives reading float, their
    weights the FP32 ONNX's), its FP16 form under export.fp16_onnx (the float layers FP16, as a strongly typed
    TensorRT 11 build runs them), ptq_partial.json and a tracking record beside it; with no layer float,
    `output` is `ptq_onnx`'s bytes and has no FP16 form, as PTQ's has none. With keep_float auto the
    layers come from `sensitivity_dir`'s sensitivity.json of the PTQ model, scored on the same val sample as
    the sensitivity stage (spec.sensitivity); a model within the budget there is scored on every val image too,
    and kept only if it is within the budget there as well."""
    from qatpipe.export.onnx_export import save_onnx
    from qatpipe.export.qdq import check_explicit_quantization
    from qatpipe.inference import onnx_forward
    from qatpipe.models import get_architecture
    from qatpipe.onnx_model import load_onnx_proto
    from qatpipe.quantization.partial import PartialResult, Step, keep_float, search
    from qatpipe.quantization.qdq_graph import fp32_weights, quantizable_layers, resolve_layers
    from qatpipe.quantization.sensitivity import exact_scorer
    from qatpipe.stages.sensitivity import val_sample

    fp32_onnx, ptq_onnx, output = Path(fp32_onnx), Path(ptq_onnx), Path(output)
    arch = get_architecture(spec)
    for path in (fp32_onnx, ptq_onnx):
        onnx_forward(path, arch)  # each fits the spec's detector, or fails naming it
    int8 = load_onnx_proto(ptq_onnx)
    reference = fp32_weights(load_onnx_proto(fp32_onnx))
    settings, budget = spec.ptq.keep_float, spec.validate_.max_map_drop
    if settings == "auto":
        order = _ranking(Path(sensitivity_dir) if sensitivity_dir else None)
    else:  # a name that is no quantizable layer fails here, naming it, before any scoring
        order = [layer.node for layer in resolve_layers(int8, settings)] if settings else []
    samples, score_path, _, provider = val_sample(spec, arch)  # the sensitivity stage's sample and scoring
    with tempfile.TemporaryDirectory(prefix="qatpipe-partial-") as folder:
        score = exact_scorer(score_path, folder)
        map50_fp32 = score_path(fp32_onnx)
        if settings == "auto":
            confirm = _confirmation(spec, arch, fp32_onnx, folder, len(samples))
            model, result = search(int8, order, score, map50_fp32, budget, reference, confirm)
        else:  # the named layers, scored for the report
            model = keep_float(int8, order, reference)
            map50 = score(model)
            map50_int8 = score(int8) if order else map50
            result = PartialResult(order, map50, map50_fp32, map50_int8, map50_fp32 - budget, budget,
                                   map50 >= map50_fp32 - budget, "list", len(quantizable_layers(int8)),
                                   [Step(order, map50)])
    check = check_explicit_quantization(model)
    if check.problems:
        raise QatpipeError(f"{output}: the partial model breaks TensorRT's Q/DQ rules: {'; '.join(check.problems[:5])}")
    output.parent.mkdir(parents=True, exist_ok=True)
    if result.float_layers:
        save_onnx(model, output)
    else:  # the PTQ model byte for byte, so its engine, benchmark and scores are PTQ's (the pipeline's SAME_AS)
        shutil.copyfile(ptq_onnx, output)
        log.info("ptq-partial: no layer kept float: the PTQ model as it is, without an FP16 form (as PTQ's)")
    report = {"source": str(ptq_onnx), "fp32_onnx": str(fp32_onnx), "onnx": str(output),
              "keep_float": settings, "val_images": len(samples),
              "scored_by": f"ONNX Runtime {provider.removesuffix('ExecutionProvider')}, exact CPU form",
              **result.to_dict(), "qdq_check": check.to_dict(),
              "size_mb": round(output.stat().st_size / 2**20, 3)}
    files = [output.name, REPORT_FILE]
    if spec.export.fp16_onnx and result.float_layers:  # the float layers' FP16 form, for TensorRT 11
        from qatpipe.stages.export import write_fp16_form

        report["fp16"] = write_fp16_form(spec, output, qat=True)
        files += [Path(report["fp16"]["onnx"]).name, *(Path(p).name for p in report["fp16"]["precision_report"])]
    write_json(output.parent / REPORT_FILE, report)
    StageRecord(
        stage="ptq_partial",
        params={"ptq.keep_float": settings if settings == "auto" else ",".join(settings),
                "validate.max_map_drop": budget, "sensitivity.val_images": spec.sensitivity.val_images},
        metrics={"float_layers": len(result.float_layers), "quantized_layers": len(check.quantized),
                 "map50_subset": result.map50, "map50_subset_fp32": map50_fp32,
                 "map50_subset_int8": result.map50_int8, "budget_met": int(result.budget_met),
                 **({"map50_all": result.map50_all} if result.map50_all is not None else {}),
                 **({"map50_all_fp32": result.map50_fp32_all} if result.map50_fp32_all is not None else {}),
                 "size_mb": report["size_mb"], "seconds": result.seconds},
        artifacts=files,
        tags={"ptq.float_layers": ",".join(result.float_layers)[:4000]},
    ).write(output.parent)
    on_all = (f"; on all {result.val_images_all} val images {result.map50_all:.4f}, FP32 {result.map50_fp32_all:.4f}"
              if result.map50_all is not None else "")
    log.info("ptq-partial: %d of %d layers float (%s): mAP@0.5 %.4f on %d val images, FP32 %.4f, all INT8 %.4f%s; "
             "budget %s", len(result.float_layers), result.layers_total, ", ".join(result.float_layers) or "none",
             result.map50, len(samples), map50_fp32, result.map50_int8, on_all,
             "met" if result.budget_met else "NOT met")
    return report


__all__ = ["ptq_partial", "REPORT_FILE"]
