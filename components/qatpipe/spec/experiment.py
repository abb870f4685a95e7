"""The experiment spec's root: one section per concern, validated together (the image size against the model's
stride)."""

from __future__ import annotations

from typing import Any

from pydantic import ConfigDict, Field, model_validator

from qatpipe.spec.architectures import ARCHITECTURE_SPECS, DEFAULT_ARCH, ModelSpec
from qatpipe.spec.base import Section
from qatpipe.spec.data import DatasetSpec
from qatpipe.spec.stage_sections import (
    AugmentationSpec,
    EngineSpec,
    EvaluateSpec,
    ExportSpec,
    PretrainSpec,
    PruneSpec,
    PtqSpec,
    QatSpec,
    RetrainSpec,
    SensitivitySpec,
    TrackingSpec,
    TrainSpec,
    ValidateSpec,
)


class ExperimentSpec(Section):
    dataset: DatasetSpec
    model: ModelSpec = Field(default_factory=lambda: ARCHITECTURE_SPECS[DEFAULT_ARCH]())
    augmentation: AugmentationSpec = Field(default_factory=AugmentationSpec)
    pretrain: PretrainSpec = Field(default_factory=PretrainSpec)
    train: TrainSpec = Field(default_factory=TrainSpec)
    evaluate: EvaluateSpec = Field(default_factory=EvaluateSpec)
    prune: PruneSpec = Field(default_factory=PruneSpec)
    retrain: RetrainSpec = Field(default_factory=RetrainSpec)
    qat: QatSpec = Field(default_factory=QatSpec)
    ptq: PtqSpec = Field(default_factory=PtqSpec)
    sensitivity: SensitivitySpec = Field(default_factory=SensitivitySpec)
    export: ExportSpec = Field(default_factory=ExportSpec)
    engine: EngineSpec = Field(default_factory=EngineSpec)
    validate_: ValidateSpec = Field(default_factory=ValidateSpec, alias="validate")
    tracking: TrackingSpec = Field(default_factory=TrackingSpec)

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    @model_validator(mode="after")
    def _check_stride(self) -> "ExperimentSpec":
        size, multiple = self.dataset.image_size, self.model.size_multiple
        if size.height % multiple or size.width % multiple:
            raise ValueError(
                f"dataset.image_size {size.height}x{size.width} must be a multiple of {multiple}, model.arch "
                f"{self.model.arch}'s largest stride"
            )
        return self

    @model_validator(mode="after")
    def _name_the_registered_model(self) -> "ExperimentSpec":
        if self.tracking.registered_model is None:
            self.tracking.registered_model = f"qatpipe-{self.model.arch.replace('_', '-')}"
        return self

    @property
    def num_classes(self) -> int:
        return len(self.dataset.classes)

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json", by_alias=True)
