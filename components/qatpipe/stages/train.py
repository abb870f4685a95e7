"""Stage: FP32 training (TAO `train`), with checkpoints and automatic resume."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict
from pathlib import Path

from qatpipe.data.splits import load_split, seeded_sample
from qatpipe.errors import QatpipeError
from qatpipe.fileio import atomic_write_text, save_keras_model, write_json
from qatpipe.metrics.diagnostics import diagnostics_metrics, findings_tags, log_findings, plateau_findings
from qatpipe.spec import STAGE_SECTIONS, ExperimentSpec, dump_spec, flatten, load_spec
from qatpipe.stages.retrain_plan import FINETUNE_FP32
from qatpipe.tracking.records import StageRecord, history_from_csv, numeric_leaves
from qatpipe.training.checkpoints import CHECKPOINT_DIR, newest_readable

log = logging.getLogger(__name__)

MODEL_FILE = "model.keras"
SPEC_FILE = "spec.yaml"
SUMMARY_FILE = "train_summary.json"
LOG_FILE = "training_log.csv"
WORLD_FILE = "world.json"  # how many data-parallel processes wrote the checkpoints
TENSORBOARD_DIR = "tensorboard"  # the event files of Keras's TensorBoard callback
PRETRAINED_REPORT = "pretrained_report.json"  # what model.pretrained loaded (models/pretrained.py's LoadReport)
# the seed of validation's sample of dataset.val (train.val_images): fixed, so a train.seed sweep and every
# training stage score the same images
VALIDATION_SEED = 0


# What a checkpoint's weights, optimizer state and data stream depend on: these, and between the two the keys of
# the architectures (theirs: DetectorArchitecture.resume_keys, e.g. model.loss, model.target). Resuming across a
# change of any of them would silently mix two experiments. `train.epochs` may change (to extend a run).
_RESUME_MODEL_KEYS = ("model.arch", "model.backbone", "model.regularizer")
_RESUME_MUST_MATCH = (
    "dataset.classes", "dataset.train", "dataset.image_size", "augmentation", "train.batch_size", "train.seed",
    "train.optimizer", "train.momentum", "train.learning_rate", "qat", "model.freeze_blocks", "model.freeze_bn",
)


def _dotted(data: dict, key: str):
    """The value at a dotted key; None where the spec has no such key (one architecture's section key in another's)."""
    for part in key.split("."):
        if part not in data:
            return None
        data = data[part]
    return data


def _set_dotted(data: dict, key: str, value) -> None:
    *parents, leaf = key.split(".")
    for part in parents:
        data = data[part]
    data[leaf] = value


def _check_resume_compatible(results_dir: Path, spec: ExperimentSpec, processes: int | None = 1) -> None:
    """Refuse to resume a checkpoint written under a spec that differs where it matters, or by another number
    of processes (the learning rate, steps per epoch and the schedule's position depend on it; None: any)."""
    world_path = results_dir / WORLD_FILE
    previous_processes = json.loads(world_path.read_text())["processes"] if world_path.is_file() else 1
    if processes is not None and previous_processes != processes:
        raise QatpipeError(
            f"{results_dir}: holds checkpoints of a run on {previous_processes} process(es); resume it with "
            f"--gpus {previous_processes}, or use a new results directory for {processes}"
        )
    previous_path = results_dir / SPEC_FILE
    if not previous_path.is_file():
        return
    from qatpipe.models import architecture_class

    previous_spec = load_spec(previous_path)
    previous_text = previous_path.read_text()
    previous, current = previous_spec.to_dict(), spec.to_dict()
    previous_arch, current_arch = architecture_class(previous_spec.model.arch), architecture_class(spec.model.arch)
    for key, meant in previous_arch.keys_added_later.items():
        if key.rpartition(".")[2] not in previous_text:  # written before the key existed: trained as `meant` says
            _set_dotted(previous, key, meant)
    arch_keys = tuple(dict.fromkeys(previous_arch.resume_keys + current_arch.resume_keys))
    must_match = _RESUME_MODEL_KEYS + arch_keys + _RESUME_MUST_MATCH
    changed = [key for key in must_match if _dotted(previous, key) != _dotted(current, key)]
    if changed:
        raise QatpipeError(
            f"{results_dir}: holds checkpoints of a run whose {', '.join(changed)} differs from this spec; "
            "use a new results directory (or delete the old one) to start over"
        )
    if previous["train"]["epochs"] != current["train"]["epochs"]:
        log.warning("train.epochs changed from %d to %d: the learning-rate schedule is stretched to the new length",
                    previous["train"]["epochs"], current["train"]["epochs"])


def _drop_redone_epochs(csv_path: Path, initial_epoch: int) -> None:
    """Epochs after the last checkpoint are trained again: drop their rows so the log has each epoch once."""
    if not csv_path.is_file():
        return
    lines = csv_path.read_text().splitlines(keepends=True)
    kept = lines[:1] + [line for line in lines[1:] if int(line.split(",", 1)[0]) < initial_epoch]
    if len(kept) != len(lines):
        atomic_write_text(csv_path, "".join(kept))


def build_optimizer(spec: ExperimentSpec, total_steps: int, lr_scale: float = 1.0):
    """The spec's optimizer; `lr_scale` multiplies the learning rates (the data-parallel world size: N
    processes take one step on N batches, so the step may be N times larger, as in TAO and Horovod)."""
    import tf_keras as keras

    from qatpipe.training.schedules import SoftStartAnnealingSchedule

    lr = spec.train.learning_rate
    schedule = SoftStartAnnealingSchedule(total_steps, lr.min_lr * lr_scale, lr.max_lr * lr_scale, lr.soft_start,
                                          lr.annealing_point)
    if spec.train.optimizer == "sgd":
        return keras.optimizers.SGD(schedule, momentum=spec.train.momentum, nesterov=True)
    return keras.optimizers.Adam(schedule, beta_1=spec.train.momentum)


def train(spec: ExperimentSpec, results_dir: str | Path, use_amp: bool | None = None, model=None,
          extra_callbacks: list | None = None, stage_name: str = "train", distillation=None,
          callbacks: list | None = None) -> dict:
    """Train the spec's detector into `results_dir`; resumes from its latest checkpoint if there is one.

    `model` (optional) starts from an existing tf_keras model instead of a fresh one (used by retrain).
    `extra_callbacks` run after the checkpoint callback (experiment tracking hooks in here), on rank 0 only;
    `callbacks` on every process, first (what changes how the model trains: retrain's late QAT freezing).
    Returns the training summary (also written to results_dir/train_summary.json); `stage_name` names the
    stage in its tracking record (results_dir/tracking.json).
    `distillation` (optional, a training.distillation.Distillation): the model also learns its teacher's
    outputs (retrain's QAT with qat.distill_weight); the saved model is the model alone.

    Under horovodrun / mpirun (`qatpipe train --gpus N`, MPIJobs) every process trains on its shard of each
    epoch with gradients averaged across processes; only rank 0 writes checkpoints, logs and the model.
    """
    import tensorflow as tf
    import tf_keras as keras

    import qatpipe.quantization.layers  # noqa: F401  (registers the QAT layers: a start may be a QAT model's file)
    from qatpipe.data.pipeline import steps_per_epoch, train_dataset
    from qatpipe.models import get_architecture
    from qatpipe.models.pretrained import check_freeze_blocks, freeze, load_pretrained
    from qatpipe.tracking.live import live_curves
    from qatpipe.training.callbacks import CheckpointEveryN, EpochLog, ProgressLogger
    from qatpipe.training.distributed import init_world
    from qatpipe.training.precision import FLOAT32, cast_model, configure_precision, model_policy
    from qatpipe.training.resume_store import upload_callback
    from qatpipe.training.validation import BEST_DIR, BestCheckpoint, ValidateEveryN

    world = init_world()
    results_dir = Path(results_dir)
    try:
        results_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise QatpipeError(f"{results_dir}: cannot create the results directory: {exc}") from None
    precision = configure_precision(spec.train.use_amp if use_amp is None else use_amp)
    keras.utils.set_random_seed(spec.train.seed)

    # checked before the data: a bad weights file or block number fails the run before any epoch
    pretrained = _pretrained_file(spec, results_dir) if model is None else None
    check_freeze_blocks(spec.model.backbone, spec.model.freeze_blocks)
    samples = load_split(spec, "train")
    arch = get_architecture(spec)
    if model is None:
        model = arch.build_model()  # a new model takes the global policy
        if pretrained:
            report = load_pretrained(model, spec.model.pretrained, spec.model.backbone, resolved=pretrained)
            if world.is_chief:
                write_json(results_dir / PRETRAINED_REPORT, report.to_dict())
    if model_policy(model) != precision.policy:  # a loaded (pruned) model keeps the one it was built under
        model = cast_model(model, precision.policy)
    # frozen blocks stay frozen in every retrain, QAT too: layers are found by name
    freeze(model, spec.model.backbone, spec.model.freeze_blocks, spec.model.freeze_bn)
    if distillation is not None:  # the same layers, with the teacher's term in the training loss
        model = distillation.wrap(model)

    steps = steps_per_epoch(len(samples), spec.train.batch_size, world.size)
    # the optimizer the model trains with (under Horovod, the wrapper that averages gradients) is the one
    # the checkpoint holds
    optimizer = world.wrap_optimizer(build_optimizer(spec, total_steps=steps * spec.train.epochs,
                                                      lr_scale=world.size))
    model.compile(optimizer=optimizer, loss=arch.losses())

    epoch_var = tf.Variable(0, dtype=tf.int64, trainable=False, name="epoch")
    checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer, epoch=epoch_var)
    # the newest checkpoint that reads back whole (rank 0 also mends the state file the manager reads)
    latest = newest_readable(results_dir / CHECKPOINT_DIR, rewrite_state=world.is_chief)
    manager = tf.train.CheckpointManager(checkpoint, results_dir / CHECKPOINT_DIR,
                                         max_to_keep=spec.train.keep_checkpoints)
    initial_epoch = _resume(spec, results_dir, checkpoint, latest, epoch_var, world)
    summary_path = results_dir / SUMMARY_FILE
    if initial_epoch >= spec.train.epochs and (results_dir / MODEL_FILE).is_file() and summary_path.is_file():
        # a finished run: keep its model and summary (throughput, losses) as they are
        log.info("%s: already trained for %d epochs; nothing to do", results_dir, initial_epoch)
        return json.loads(summary_path.read_text())

    validator = _validator(spec, arch) if world.is_chief else None  # rank 0 validates
    best = BestCheckpoint(results_dir / BEST_DIR, resumed_at=initial_epoch) if validator else None
    validating = ValidateEveryN(validator, spec.train.validation_interval, spec.train.epochs, best) \
        if validator else None
    # the job's images per step: every process takes a batch (rank 0 logs the whole job's throughput)
    progress = ProgressLogger(steps, spec.train.epochs, spec.train.batch_size * world.size,
                              spec.train.log_every_n_steps)
    started = time.perf_counter()
    if initial_epoch < spec.train.epochs:
        if world.is_chief:
            dump_spec(spec, results_dir / SPEC_FILE)  # from here on, checkpoints belong to this spec
            write_json(results_dir / WORLD_FILE, {"processes": world.size})
            _drop_redone_epochs(results_dir / LOG_FILE, initial_epoch)
        dataset, _ = train_dataset(samples, spec, arch, initial_epoch=initial_epoch, shard=world.shard)
        log.info(
            "training %s on %d images: epochs %d..%d, %d steps/epoch, batch %d%s, %s",
            model.name, len(samples), initial_epoch + 1, spec.train.epochs, steps, spec.train.batch_size,
            f" x {world.size} processes (learning rate x {world.size})" if world.distributed else "",
            precision.policy,
        )
        # validation after the progress line (its time is not training time) and before the log row and
        # TensorBoard, which get its numbers; the log row before the checkpoint, so a run stopped between the
        # two trains the epoch again (and logs it again) instead of losing its row
        chief_callbacks = [
            progress, *([validating] if validating else []), EpochLog(results_dir / LOG_FILE),
            CheckpointEveryN(manager, epoch_var, spec.train.checkpoint_interval, spec.train.epochs),
            *([mirror] if (mirror := upload_callback(results_dir, manager)) else []),  # S3 resume state
            keras.callbacks.TensorBoard(str(results_dir / TENSORBOARD_DIR), update_freq="epoch", profile_batch=0),
            *([curves] if (curves := live_curves(stage_name, steps, spec.train.batch_size * world.size)) else []),
            *(extra_callbacks or []),
        ]
        history = model.fit(
            dataset, epochs=spec.train.epochs, initial_epoch=initial_epoch, steps_per_epoch=steps,
            verbose=0,
            callbacks=[*world.callbacks(), *(callbacks or []), *(chief_callbacks if world.is_chief else [])],
        )
        final_losses = {k: float(v[-1]) for k, v in history.history.items() if not k.startswith("val_")}
    else:  # finished, but stopped before the model was exported
        log.info("%s: already trained for %d epochs; exporting the model", results_dir, initial_epoch)
        final_losses = {}

    kept = _keep_weights(spec, model, validator, validating, best) if world.is_chief else None
    # Save an uncompiled float32 twin: no optimizer state, custom losses or training policy, so later stages
    # load it plainly.
    export = (cast_model(model, FLOAT32) if precision.mixed else
              keras.Model(model.inputs, model.outputs, name=model.name))
    model_path = results_dir / MODEL_FILE
    if world.is_chief:
        model_path = save_keras_model(export, model_path)
    summary = {
        "model": str(model_path), "epochs": spec.train.epochs, "resumed_from_epoch": initial_epoch,
        "epochs_run": spec.train.epochs - initial_epoch, "train_images": len(samples), "steps_per_epoch": steps,
        "images_per_second": round(progress.images_per_second, 2),  # the whole job's
        "processes": world.size, "epoch_seconds": progress.epoch_seconds,
        "wall_seconds": round(time.perf_counter() - started, 2), "params": int(model.count_params()),
        "final_losses": final_losses, "mixed_precision": precision.mixed, "precision": precision.policy,
        "val_images": len(validator.samples) if validator else None,  # what each validation scored
        **_validation_summary(spec, results_dir, kept, best),
    }
    if not world.is_chief:
        return summary
    log_findings(summary["diagnostics"]["findings"] if summary["diagnostics"] else [], "training")
    write_json(summary_path, summary)
    _write_tracking_record(spec, results_dir, summary, stage_name)
    log.info("model saved: %s (%d params)", model_path, summary["params"])
    return summary


def _pretrained_file(spec: ExperimentSpec, results_dir: Path) -> str | None:
    """model.pretrained checked and made local (an s3:// file downloaded), for a new model; None when it is
    not set or the run resumes from a checkpoint (whose weights win)."""
    from qatpipe.models.pretrained import resolve_pretrained
    from qatpipe.training.checkpoints import checkpoint_prefixes

    if not spec.model.pretrained:
        return None
    if checkpoint_prefixes(results_dir / CHECKPOINT_DIR):
        log.info("model.pretrained is not loaded: the run resumes from its checkpoint")
        return None
    return resolve_pretrained(spec.model.pretrained, spec.model.backbone, spec.dataset.cache_dir)


def _resume(spec: ExperimentSpec, results_dir: Path, checkpoint, latest: str | None, epoch_var, world) -> int:
    """The epoch training starts from: checkpoint `latest`'s (restored into `checkpoint`, after checking it
    was written under this spec and process count), else 0; the same on every process."""
    import tensorflow as tf

    if latest:
        saved_epoch = int(tf.train.load_variable(latest, "epoch/.ATTRIBUTES/VARIABLE_VALUE"))
        finished = saved_epoch >= spec.train.epochs and (results_dir / MODEL_FILE).is_file()
        # a finished run is only read back: any process count may do that
        _check_resume_compatible(results_dir, spec, None if finished else world.size)
        checkpoint.restore(latest).expect_partial()
        log.info("resuming from %s at epoch %d/%d", latest, int(epoch_var), spec.train.epochs)
    initial_epoch = world.broadcast(int(epoch_var.numpy()), "initial_epoch")
    if initial_epoch > spec.train.epochs:
        raise QatpipeError(
            f"{results_dir}: the checkpoint is at epoch {initial_epoch}, beyond train.epochs={spec.train.epochs}"
        )
    return initial_epoch


def _validator(spec: ExperimentSpec, arch):
    """The val set's Validator; None when validation is off or there is no val set to validate on."""
    from qatpipe.training.validation import Validator

    if spec.train.validation_interval == 0:
        log.info("validation during training is off (train.validation_interval: 0): model.keras is the last epoch")
        return None
    if spec.dataset.val is None:
        log.warning("dataset.val is not set: no validation during training; model.keras is the last epoch")
        return None
    samples = validation_samples(spec)
    if not any(len(sample.classes) for sample in samples):
        log.warning("dataset.val has no labelled objects: no validation during training; model.keras is the "
                    "last epoch")
        return None
    return Validator(spec, arch, samples)


def validation_samples(spec: ExperimentSpec) -> list:
    """The dataset.val images validation during training scores: train.val_images of them drawn with a fixed
    seed (the same every epoch, in train and every retrain, whatever train.seed), or all when it is null."""
    everything = load_split(spec, "val")
    count = spec.train.val_images
    samples = everything if count is None else seeded_sample(everything, count, VALIDATION_SEED)
    log.info("validation during training scores %d of the %d dataset.val images (train.val_images: %s); the "
             "final evaluations score all of them", len(samples), len(everything), count)
    return samples


def _keep_weights(spec: ExperimentSpec, model, validator, validating, best) -> dict | None:
    """Put the weights `train.keep` asks for into `model`; returns their validation ({epoch, metrics,
    diagnostics}), or None without validation."""
    if validator is None:
        return None
    if spec.train.keep == "best" and best.record:
        best.restore(model)
        log.info("model.keras: the weights of epoch %d, the best val mAP@0.5 (%.4f)", best.record["epoch"],
                 best.record["val_map50"])
        return {**best.record, "kept": "best"}
    # the last epoch was validated unless this run only exports a finished one
    last = validating.last or validator(model, spec.train.epochs)
    return {**asdict(last), "kept": "last"}


def _validation_summary(spec: ExperimentSpec, results_dir: Path, kept: dict | None, best) -> dict:
    """train_summary.json's view of the validation: which weights model.keras holds, the best epoch, the kept
    weights' val numbers and their learning check (with the training loss plateau check)."""
    if kept is None:
        return {"kept": "last", "kept_epoch": spec.train.epochs, "best_epoch": None, "best_val_map50": None,
                "validation": None, "diagnostics": None}
    losses = [value for _, value in history_from_csv(results_dir / LOG_FILE).get("loss", [])]
    diagnostics = dict(kept["diagnostics"])
    diagnostics["findings"] = [*diagnostics["findings"],
                               *(asdict(f) for f in plateau_findings(losses, kept["metrics"]["val_map50"]))]
    record = best.record or {}
    return {"kept": kept["kept"], "kept_epoch": kept["epoch"], "best_epoch": record.get("epoch"),
            "best_val_map50": record.get("val_map50"), "validation": kept["metrics"],
            "diagnostics": {"epoch": kept["epoch"], **diagnostics}}


def summary_metrics(summary: dict) -> dict[str, float]:
    """A training summary's figures for MLflow and the KFP UI: throughput, time, size, final losses, the kept
    and best epochs, the best val mAP@0.5 and the learning check's tracked metrics."""
    metrics = numeric_leaves({key: summary.get(key) for key in ("images_per_second", "wall_seconds", "params",
                                                                "final_losses", "kept_epoch", "best_epoch",
                                                                "best_val_map50")
                              if summary.get(key) is not None})
    metrics.update(diagnostics_metrics(summary.get("diagnostics")))
    return metrics


def _write_tracking_record(spec: ExperimentSpec, results_dir: Path, summary: dict, stage_name: str) -> None:
    # the FP32 control of a QAT fine-tuning records the qat section too: its start and epochs come from there
    view = STAGE_SECTIONS["train" if stage_name == "train" else "finetune_fp32" if stage_name == FINETUNE_FP32
                          else "retrain_qat" if spec.qat.enabled else "retrain"]
    sections = {key: value for key, value in spec.to_dict().items() if key in view}
    diagnostics = summary["diagnostics"] or {}
    metrics = summary_metrics(summary)
    StageRecord(
        stage=stage_name, params={**flatten(sections), "precision": summary["precision"]}, metrics=metrics,
        history=history_from_csv(results_dir / LOG_FILE),
        artifacts=[MODEL_FILE, LOG_FILE, SUMMARY_FILE, SPEC_FILE,
                   *([PRETRAINED_REPORT] if (results_dir / PRETRAINED_REPORT).is_file() else [])],
        tags={"qatpipe.kept": summary["kept"], **(findings_tags(diagnostics["findings"]) if diagnostics else {})},
    ).write(results_dir)


__all__ = ["train", "build_optimizer", "summary_metrics", "MODEL_FILE"]
