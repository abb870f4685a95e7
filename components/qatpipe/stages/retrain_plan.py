"""Where each of the pipeline's retrains starts under `qat.start`, and the stage names they record: the FP32
retrain always from the pruned model; QAT from the pruned model (TAO's order), fine-tuning the FP32 retrain's
model (NVIDIA's QAT toolkit's) or briefly fine-tuning the FP32 baseline itself (the textbook order); the FP32
baseline is the FP32 retrain's model as it is (TAO's order, and the baseline order with qat.finetune_epochs 0), or
that model fine-tuned in FP32 (as long as QAT fine-tunes it under fp32, so that both have had the same training).

Its own module, imported by both the train and the retrain stages (train names the FP32 baseline's record), so
that neither imports the other for it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from qatpipe.errors import QatpipeError
from qatpipe.spec import ExperimentSpec, LearningRateSpec

RETRAIN_FP32 = "retrain_fp32"
RETRAIN_QAT = "retrain_qat"
# the FP32 baseline's stage: the FP32 control of a QAT fine-tuning, or the FP32 retrain handed on
FINETUNE_FP32 = "finetune_fp32"


@dataclass(frozen=True)
class RetrainPlan:
    """What one retrain does: train `source` for `epochs` (None: train nothing and hand `source` on as the
    result) under `learning_rate` (None: train.learning_rate), recorded as `stage_name`."""

    source: Path
    epochs: int | None
    stage_name: str
    learning_rate: LearningRateSpec | None = None

    @property
    def hands_on(self) -> bool:
        return self.epochs is None

    def applied(self, spec: ExperimentSpec) -> ExperimentSpec:
        """`spec` as this retrain trains under it: its epochs and learning-rate schedule."""
        spec = spec.model_copy(deep=True)
        spec.retrain.epochs = self.epochs
        if self.learning_rate is not None:
            spec.train.learning_rate = self.learning_rate.model_copy()
        return spec


def plan_retrain(spec: ExperimentSpec, qat: bool, pruned: str | Path, retrained: str | Path | None = None,
                 baseline: str | Path | None = None) -> RetrainPlan:
    """Where a retrain starts and for how long. `retrained`: the FP32 retrain's model, given to the retrains
    that come after it (the QAT one and the FP32 baseline); without it, a retrain of the pruned model.
    `baseline`: the FP32 baseline's model, which QAT fine-tunes under qat.start baseline."""
    pruned = Path(pruned)
    first = spec.retrain.epochs or spec.train.epochs
    if retrained is None:
        return RetrainPlan(pruned, first, RETRAIN_QAT if qat else RETRAIN_FP32)
    if qat and spec.qat.start == "baseline":
        if baseline is None:
            raise QatpipeError("qat.start is baseline: the QAT fine-tuning needs the FP32 baseline's model "
                               "(finetune-fp32's), and none was given")
        return RetrainPlan(Path(baseline), spec.qat.epochs, RETRAIN_QAT, spec.qat.learning_rate)
    if not qat and spec.qat.start == "baseline" and spec.qat.finetune_epochs == 0:
        return RetrainPlan(Path(retrained), None, FINETUNE_FP32)  # one FP32 training: the retrain is the baseline
    if spec.qat.start in ("fp32", "baseline"):
        return RetrainPlan(Path(retrained), spec.qat.finetune_epochs or first,
                           RETRAIN_QAT if qat else FINETUNE_FP32, spec.qat.finetune_learning_rate)
    if qat:  # TAO's order: QAT retrains the pruned model, as the FP32 retrain did
        return RetrainPlan(pruned, first, RETRAIN_QAT)
    return RetrainPlan(Path(retrained), None, FINETUNE_FP32)


def training_epochs(spec: ExperimentSpec) -> int:
    """Epochs over the training set that a pipeline run trains in all, under `qat.start`: train, retrain-fp32,
    finetune-fp32 and retrain-qat (times the training images: the run's training image passes)."""
    first = spec.retrain.epochs or spec.train.epochs
    qat = spec.qat
    if qat.start == "pruned":  # QAT retrains the pruned model as the FP32 retrain does; the baseline is handed on
        return spec.train.epochs + 2 * first
    finetune = first if qat.finetune_epochs is None else qat.finetune_epochs
    qat_epochs = qat.epochs if qat.start == "baseline" else finetune
    return spec.train.epochs + first + finetune + qat_epochs


__all__ = ["FINETUNE_FP32", "RETRAIN_FP32", "RETRAIN_QAT", "RetrainPlan", "plan_retrain", "training_epochs"]
