"""The experiment spec: one YAML file, typed and validated, with TAO-like sections.

Every stage reads its settings from here; nothing else defines defaults, and the defaults are the bundled
default recipe (specs/default.yaml names only its data), so a spec naming only `dataset:` runs what
`--spec default` runs. Unknown keys are errors (`extra="forbid"`) so a typo never silently falls back to a
default. The modules: base (what every section
shares), data (the dataset section), architectures (the model section of each architecture), stage_sections
(the stages' sections), experiment (the root), load (files, overrides, the bundled specs), views (what each
pipeline stage reads), errors (validation errors one line per key). Callers import from `qatpipe.spec`.
"""

from qatpipe.spec.architectures import (
    ARCHITECTURE_SPECS,
    ARCHITECTURES,
    Architecture,
    DEFAULT_ARCH,
    OUTPUT_STRIDE,
    PIPELINE_PRETRAINED,
    BackboneSpec,
    DecoderSpec,
    DetectNetV2Spec,
    LossSpec,
    ModelSpec,
    RegularizerSpec,
    SsdDecoderSpec,
    SsdLossSpec,
    SsdPriorSpec,
    SsdSpec,
    SsdTargetSpec,
    TargetSpec,
)
from qatpipe.spec.base import Section, field_choices, field_default
from qatpipe.spec.data import DatasetSpec, ImageSize, SyntheticDataSpec
from qatpipe.spec.errors import format_validation_error
from qatpipe.spec.experiment import ExperimentSpec
from qatpipe.spec.load import (
    apply_overrides,
    bundled_spec_path,
    dump_spec,
    flatten,
    load_spec,
    load_spec_text,
    parse_spec,
    spec_to_yaml,
)
from qatpipe.spec.stage_sections import (
    PTQ_DEFAULT_METHODS,
    AugmentationSpec,
    EngineBenchSpec,
    EngineSpec,
    EvaluateSpec,
    ExportSpec,
    LearningRateSpec,
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
from qatpipe.spec.views import SETTING_SECTIONS, STAGE_SECTIONS, spec_output_name, stage_view

__all__ = [
    "ARCHITECTURE_SPECS", "ARCHITECTURES", "Architecture", "DEFAULT_ARCH", "OUTPUT_STRIDE", "PIPELINE_PRETRAINED", "PTQ_DEFAULT_METHODS",
    "SETTING_SECTIONS", "STAGE_SECTIONS", "AugmentationSpec", "BackboneSpec", "DatasetSpec", "DecoderSpec",
    "DetectNetV2Spec", "EngineBenchSpec", "EngineSpec", "EvaluateSpec", "ExperimentSpec", "ExportSpec", "ImageSize",
    "LearningRateSpec", "LossSpec", "ModelSpec", "PretrainSpec", "PruneSpec", "PtqSpec", "QatSpec", "RegularizerSpec",
    "RetrainSpec", "Section", "SensitivitySpec", "SsdDecoderSpec", "SsdLossSpec", "SsdPriorSpec", "SsdSpec",
    "SsdTargetSpec", "SyntheticDataSpec", "TargetSpec", "TrackingSpec", "TrainSpec", "ValidateSpec",
    "apply_overrides", "bundled_spec_path", "dump_spec", "field_choices", "field_default", "flatten",
    "format_validation_error", "load_spec", "load_spec_text", "parse_spec", "spec_output_name", "spec_to_yaml",
    "stage_view",
]
