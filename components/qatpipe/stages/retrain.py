"""Stage: retrain a pruned detector (TAO `train` with `pruned_model_path`): fine-tuning that recovers the
accuracy pruning took, in FP32 or, with `qat.enabled` (TAO's `enable_qat`), quantization-aware. Same training
loop, schedule, checkpoints and resume as `train`; the model comes from the pruned file, `retrain.epochs`
replaces `train.epochs`. Where each of the pipeline's retrains starts under `qat.start` is stages/retrain_plan.py's
`plan_retrain`; `hand_on` is the retrain that trains nothing."""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from pathlib import Path

from qatpipe.errors import QatpipeError
from qatpipe.fileio import read_json, write_json
from qatpipe.spec import ExperimentSpec
from qatpipe.stages.retrain_plan import FINETUNE_FP32, RETRAIN_FP32, RETRAIN_QAT

log = logging.getLogger(__name__)

SOURCE_FILE = "source_model.json"
QAT_RANGES_FILE = "qat_ranges.json"
AUTO_FOLDER = "qat_auto"  # qat.excluded_layers auto: the FP32 start's export, PTQ, sensitivity and search
AUTO_FILE = "excluded_layers.json"  # ... and the layer names QAT keeps float, written last


def hand_on(retrained_dir: str | Path, results_dir: str | Path) -> dict:
    """The FP32 baseline as the FP32 retrain's model (qat.start: pruned, or baseline with qat.finetune_epochs 0):
    the FP32 retrain's results copied to `results_dir` as they are, with a tracking record that says so; returns
    its training summary."""
    from qatpipe.stages.train import SUMMARY_FILE
    from qatpipe.tracking.records import RECORD_FILE, StageRecord

    retrained_dir, results_dir = Path(retrained_dir), Path(results_dir)
    shutil.copytree(retrained_dir, results_dir, dirs_exist_ok=True, ignore=shutil.ignore_patterns(RECORD_FILE))
    summary = json.loads((results_dir / SUMMARY_FILE).read_text())
    StageRecord(FINETUNE_FP32, params={"trained": False},
                tags={"note": "the FP32 baseline is the FP32 retrain's model, unchanged (qat.start pruned, or "
                              "baseline with qat.finetune_epochs 0)"}).write(results_dir)
    log.info("the FP32 baseline is the FP32 retrain's model (%s), handed on unchanged", retrained_dir)
    return summary


def retrain_spec(spec: ExperimentSpec) -> ExperimentSpec:
    """The spec the retraining trains with: `retrain.epochs` in place of `train.epochs`."""
    spec = spec.model_copy(deep=True)
    if spec.retrain.epochs is not None:
        spec.train.epochs = spec.retrain.epochs
    return spec


def retrain(spec: ExperimentSpec, pruned_model_path: str | Path, results_dir: str | Path,
            use_amp: bool | None = None, stage_name: str | None = None) -> dict:
    """Fine-tune the pruned model into `results_dir` (model.keras, checkpoints, logs, tracking.json); a QAT
    model when spec.qat.enabled (its activation ranges also go to qat_ranges.json).

    With qat.excluded_layers auto, QAT keeps float the layers auto_excluded_layers finds in the model it starts
    from (its reports in results_dir/qat_auto).

    With qat.distill_weight > 0 QAT also distils from the FP32 model it starts from, `pruned_model_path` itself,
    frozen (training/distillation.py): under qat.start fp32 the FP32 retrain's model, under qat.start baseline
    the FP32 baseline, under qat.start pruned (TAO's order) the pruned model before any retraining."""
    from qatpipe.models import get_architecture
    from qatpipe.models.io import load_keras_model
    from qatpipe.quantization.freeze import freeze_late
    from qatpipe.stages.train import train
    from qatpipe.training.distributed import init_world

    world = init_world()  # before TensorFlow starts: under Horovod it pins this process's GPU
    spec = retrain_spec(spec)
    qat = spec.qat.enabled
    stage_name = stage_name or (RETRAIN_QAT if qat else RETRAIN_FP32)
    pruned_model_path = Path(pruned_model_path)
    results_dir = Path(results_dir)
    arch = get_architecture(spec)
    model = load_keras_model(pruned_model_path, arch)
    _claim(results_dir, pruned_model_path, write=world.is_chief)
    auto = qat and spec.qat.excluded_layers == "auto"
    if qat:
        if auto:  # found once, by rank 0; Horovod's other ranks wait for its names and build the same model
            found = auto_excluded_layers(spec, pruned_model_path, results_dir) if world.is_chief else None
            spec.qat.excluded_layers = world.broadcast(found and found["excluded_layers"],
                                                       "qat_excluded_layers_auto")
        if use_amp is True or (use_amp is None and spec.train.use_amp is True):  # asked for, not `auto`
            log.warning("QAT trains in FP32: fake quantization under mixed precision would not match TensorRT's int8")
        use_amp = False
        teacher = model  # the FP32 model as loaded; QAT trains a rebuilt twin with weights of its own
        model = _prepare_qat(spec, model, results_dir)
        distillation = _distillation(spec, arch, teacher, pruned_model_path)  # frozen now the twin is built
    else:
        distillation = None
    log.info("retraining %s (%d params, %s)", pruned_model_path, model.count_params(), "QAT" if qat else "FP32")
    summary = train(spec, results_dir, use_amp=use_amp, model=model, stage_name=stage_name,
                    distillation=distillation, callbacks=freeze_late(spec.qat) if qat else None)
    summary["source_model"] = str(pruned_model_path)
    if not world.is_chief:  # under Horovod, rank 0 writes the results
        return summary
    if qat:
        from qatpipe.quantization.transform import activation_ranges

        summary["qat"] = {"activation_ranges": len(activation_ranges(model))}
        write_json(results_dir / QAT_RANGES_FILE, activation_ranges(model))
    if auto:
        summary["qat"]["excluded_layers_auto"] = _record_auto(spec, results_dir, found)
    return summary


def _record_auto(spec: ExperimentSpec, results_dir: Path, found: dict) -> dict:
    """The retrain's tracking record gets qat.excluded_layers auto's search (`found`, auto_excluded_layers'): the
    settings that chose the layers, their names, the search's figures and reports."""
    from qatpipe.stages.ptq_partial import REPORT_FILE
    from qatpipe.tracking.records import StageRecord

    record = StageRecord.read(results_dir)
    record.params.update({"qat.excluded_layers.source": "auto", "validate.max_map_drop": spec.validate_.max_map_drop,
                          **{f"ptq.{key}": getattr(spec.ptq, key) for key in ("tool", "calibration_images")},
                          "ptq.method": spec.ptq.calibration_method,
                          **{f"sensitivity.{key}": value for key, value in spec.sensitivity.model_dump().items()}})
    record.tags["qat.excluded_layers"] = "auto: " + (",".join(found["excluded_layers"]) or "none")[:4000]
    record.metrics.update({"qat_auto.float_layers": len(found["excluded_layers"]),
                           "qat_auto.budget_met": int(found["budget_met"]),
                           **{f"qat_auto.{key}": found[key] for key in ("map50_subset", "map50_subset_fp32",
                                                                         "map50_subset_int8")}})
    reports = [f"{AUTO_FOLDER}/{AUTO_FILE}", f"{AUTO_FOLDER}/sensitivity", f"{AUTO_FOLDER}/partial/{REPORT_FILE}"]
    record.artifacts += [name for name in reports if name not in record.artifacts]  # a re-run trains nothing
    record.write(results_dir)
    return found


def auto_excluded_layers(spec: ExperimentSpec, fp32_model: Path, results_dir: Path) -> dict:
    """qat.excluded_layers auto: the layers partial PTQ keeps float in `fp32_model`, the FP32 model QAT starts
    from, to come within validate.max_map_drop of it, as the pipeline's tasks would find them for that model: its
    ONNX export, its PTQ, the PTQ model's layer sensitivity, then ptq.keep_float auto's search (fewest layers
    first). Returns what it found: their Keras layer names (`excluded_layers`), the ONNX nodes and the search's
    figures. The reports go to results_dir/qat_auto (the models made on the way are deleted: they would travel
    with the QAT model), and a resumed retrain reads what was found back from there."""
    from qatpipe.quantization.qdq_graph import layer_name
    from qatpipe.stages.export import export
    from qatpipe.stages.ptq import ptq
    from qatpipe.stages.ptq_partial import ptq_partial
    from qatpipe.stages.sensitivity import sensitivity
    from qatpipe.tracking.records import RECORD_FILE

    folder = results_dir / AUTO_FOLDER
    saved = folder / AUTO_FILE
    if saved.is_file():
        what = "layers qat.excluded_layers auto found (delete the file to search again)"
        found = read_json(saved, what)
        if not isinstance(found, dict) or not isinstance(found.get("excluded_layers"), list):
            raise QatpipeError(f"{saved}: cannot read the {what}: no `excluded_layers` list")
        log.info("qat.excluded_layers auto: %s, as found before for %s (%s; delete it to search again)",
                 ", ".join(found["excluded_layers"]) or "none", found["source"], saved)
        return found
    probe = spec.model_copy(deep=True)  # the tasks' settings, less the side files QAT does not read
    probe.export.fp16_onnx, probe.export.target, probe.ptq.report_images = False, "gpu", 0
    probe.ptq.keep_float = "auto"
    log.info("qat.excluded_layers auto: searching %s's PTQ for the layers to keep float (%s)", fp32_model, folder)
    fp32_onnx, ptq_onnx = folder / "fp32" / "model.onnx", folder / "ptq" / "model.onnx"
    export(probe, fp32_model, fp32_onnx)
    ptq(probe, fp32_onnx, ptq_onnx)
    sensitivity(probe, ptq_onnx, folder / "sensitivity", fp32_onnx)
    report = ptq_partial(probe, fp32_onnx, ptq_onnx, folder / "partial" / "model.onnx", folder / "sensitivity")
    names = list(dict.fromkeys(layer_name(node) for node in report["float_layers"]))  # the Keras layers
    found = {"excluded_layers": names, "float_nodes": report["float_layers"], "map50_subset": report["map50"],
             "map50_subset_fp32": report["map50_fp32"], "map50_subset_int8": report["map50_int8"],
             "val_images": report["val_images"], "budget": report["budget"], "budget_met": report["budget_met"],
             "source": str(fp32_model)}
    shutil.rmtree(folder / "fp32")
    shutil.rmtree(folder / "ptq")
    (folder / "partial" / "model.onnx").unlink()
    for record in folder.rglob(RECORD_FILE):  # the stages' records: this retrain's record carries the search
        record.unlink()
    write_json(saved, found)
    log.info("qat.excluded_layers auto: %s (PTQ of the FP32 start: %.4f with them float, %.4f all INT8, FP32 "
             "%.4f on %d val images; budget %s)", ", ".join(names) or "none", found["map50_subset"],
             found["map50_subset_int8"], found["map50_subset_fp32"], found["val_images"],
             "met" if found["budget_met"] else "NOT met")
    return found


def _distillation(spec: ExperimentSpec, arch, teacher, source: Path):
    """QAT's distillation from `teacher` (the FP32 model at `source`) when qat.distill_weight asks for it."""
    if not spec.qat.distill_weight:
        return None
    from qatpipe.training.distillation import Distillation

    log.info("QAT distils from its FP32 teacher %s (qat.distill_weight %g: %s)", source, spec.qat.distill_weight,
             ", ".join(arch.output_names))
    return Distillation(teacher, arch.distill_losses(), spec.qat.distill_weight, arch.output_names)


def _prepare_qat(spec: ExperimentSpec, model, results_dir: Path):
    """The QAT twin of `model`, its activation ranges calibrated on training images (a resumed run takes them
    from its checkpoint instead)."""
    from qatpipe.data.pipeline import eval_dataset
    from qatpipe.data.splits import sample_split
    from qatpipe.quantization.transform import calibrate, quantize_model
    from qatpipe.training.checkpoints import CHECKPOINT_DIR, checkpoint_prefixes

    model = quantize_model(model, spec.qat)
    if checkpoint_prefixes(results_dir / CHECKPOINT_DIR):
        return model  # the ranges come back with the checkpoint (train refuses a checkpoint of other qat settings)
    batch_size = spec.train.batch_size
    samples = sample_split(spec, "train", spec.qat.calibration_batches * batch_size, spec.train.seed)
    batches = (batch.numpy() for batch in eval_dataset(samples, spec, batch_size))
    calibrate(model, batches, spec.qat.calibration_batches)
    return model


def _claim(results_dir: Path, source: Path, write: bool = True) -> None:
    """Checkpoints in `results_dir` belong to one pruned model: refuse to resume them onto another."""
    digest = hashlib.sha256(source.read_bytes()).hexdigest()
    marker = results_dir / SOURCE_FILE
    if marker.is_file():
        previous = json.loads(marker.read_text())
        if previous.get("sha256") != digest:
            raise QatpipeError(
                f"{results_dir}: holds a retraining of another pruned model ({previous.get('path')}); use a new "
                f"results directory for {source}"
            )
        return
    if not write:
        return
    results_dir.mkdir(parents=True, exist_ok=True)
    write_json(marker, {"path": str(source), "sha256": digest})


__all__ = ["hand_on", "retrain", "retrain_spec", "auto_excluded_layers", "AUTO_FOLDER", "AUTO_FILE"]
