"""The spec views: which sections each pipeline stage reads, so a KFP cache key changes only when something
that stage depends on changes."""

from __future__ import annotations

from typing import Callable

import yaml

from qatpipe.errors import SpecError
from qatpipe.spec.experiment import ExperimentSpec


# Which spec sections each pipeline stage reads: the one table. A stage gets only these (the rest left at
# defaults; SETTING_SECTIONS below adds a few where a setting makes a stage read more), so a KFP cache key
# changes only when something that stage depends on changes: editing `validate` does not retrain. resolve-spec
# hands each view on as its output `<view>_spec` (spec_output_name), and the tests check its outputs and their
# descriptions against this table. A new view adds its line here and its output to resolve-spec's signature
# (KFP reads outputs from the source), which the tests then demand.
STAGE_SECTIONS: dict[str, tuple[str, ...]] = {
    "data": ("dataset",),  # fingerprint-data and prepare-data
    "train": ("dataset", "model", "augmentation", "train", "evaluate"),  # evaluate: validation during training
    "evaluate": ("dataset", "model", "evaluate"),
    "prune": ("dataset", "model", "prune"),
    "retrain": ("dataset", "model", "augmentation", "train", "evaluate", "retrain"),
    "retrain_qat": ("dataset", "model", "augmentation", "train", "evaluate", "retrain", "qat"),
    # the FP32 baseline fine-tuned as QAT is: qat.start, finetune_epochs and finetune_learning_rate, never what only QAT
    # reads
    "finetune_fp32": ("dataset", "model", "augmentation", "train", "evaluate", "retrain", "qat"),
    "export": ("dataset", "model", "export"),
    "ptq": ("dataset", "model", "evaluate", "ptq"),
    "sensitivity": ("dataset", "model", "evaluate", "sensitivity"),  # scored as evaluate scores
    # export: the partial model's FP16 form (export.fp16_onnx); validate: keep_float auto's budget, max_map_drop
    "ptq_partial": ("dataset", "model", "evaluate", "export", "ptq", "sensitivity", "validate"),
    "engine": ("dataset", "model", "engine"),
    "validate": ("dataset", "model", "evaluate", "engine", "validate"),
    "pretrain": ("dataset", "model", "pretrain"),
}


# Sections a view carries only under a setting that reads them, so that changing them re-runs no task that does
# not: qat.excluded_layers auto makes the QAT retrain export, PTQ-calibrate and search its FP32 start as the
# export, ptq, sensitivity and ptq-partial tasks do (their sections; validate: the budget)
SETTING_SECTIONS: tuple[tuple[str, tuple[str, ...], str, Callable[[ExperimentSpec], bool]], ...] = (
    ("retrain_qat", ("export", "ptq", "sensitivity", "validate"), "qat.excluded_layers auto",
     lambda spec: spec.qat.excluded_layers == "auto"),
)


def spec_output_name(view: str) -> str:
    """resolve-spec's output that carries a view of STAGE_SECTIONS."""
    return f"{view}_spec"


def stage_view(spec: ExperimentSpec, stage: str) -> str:
    """The spec YAML that `stage` needs (see STAGE_SECTIONS, and SETTING_SECTIONS where a setting asks for more)."""
    try:
        sections = STAGE_SECTIONS[stage]
    except KeyError:
        raise SpecError(f"no spec view for stage {stage!r}; add it to STAGE_SECTIONS") from None
    sections += tuple(section for view, extra, _, needed in SETTING_SECTIONS if view == stage and needed(spec)
                      for section in extra if section not in sections)
    full = spec.to_dict()
    view = {key: full[key] for key in sections}
    if "model" not in view:  # the arch alone: the view then checks its image size against that arch's stride,
        view["model"] = {"arch": full["model"]["arch"]}  # not the default arch's
    return yaml.safe_dump(view, sort_keys=False)
