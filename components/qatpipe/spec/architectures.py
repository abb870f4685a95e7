"""The model section: one per architecture (DetectNet_v2, SSD), picked by model.arch, with what they share
(backbone, regulariser, where the weights start). Everything architecture-specific in the spec lives here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal, Union

from pydantic import Discriminator, Field, Tag, model_validator

from qatpipe.errors import SpecError
from qatpipe.spec.base import Section
from qatpipe.spec.registries import BACKBONES


class BackboneSpec(Section):
    """The feature extractor under the detection heads, stride 16 whichever it is (models/backbones.py)."""

    name: str = Field("resnet", description="a backbone of spec/registries.py's BACKBONES (an unknown "
                                            "name's error lists them)")
    depth: Literal[10, 18, 34] = Field(10, description="resnet only: 10, 18 or 34 layers")
    width: float = Field(0.5, gt=0, le=2.0, description="multiplier on every filter count (ResNet's 64-128-256-"
                                                        "512, MobileNetV2's alpha, EfficientNet's width)")
    all_projections: bool = Field(True, description="resnet only: 1x1 conv shortcut in every block (TAO default)")

    @model_validator(mode="after")
    def _check_name(self) -> "BackboneSpec":
        if self.name not in BACKBONES:
            raise ValueError(f"name {self.name!r} is not a backbone: one of {', '.join(BACKBONES)}")
        return self


class RegularizerSpec(Section):
    type: Literal["l1", "l2", "none"] = "l1"  # L1 drives filter norms to zero: makes pruning effective
    weight: float = Field(1e-5, ge=0)


class TargetSpec(Section):
    """Ground truth -> coverage/bbox tensors (DetectNet_v2's target encoder)."""

    coverage_ratio: float = Field(
        0.6, gt=0, le=1,
        # narrow objects (pedestrians) get a single covered column at 0.4, too little training signal
        description="central fraction of each box (per side) whose cells get coverage 1",
    )
    bbox_norm: float = Field(35.0, gt=0, description="pixels per unit of the bbox regression targets")


class DecoderSpec(Section):
    """Network outputs -> boxes (DetectNet_v2's clustering)."""

    method: Literal["nms", "dbscan"] = "nms"
    coverage_threshold: float = Field(
        0.05, ge=0, le=1, description="cells below this coverage are ignored (low for mAP, like TAO's evaluation)"
    )
    nms_iou: float = Field(0.5, gt=0, le=1)
    dbscan_eps: float = Field(0.3, gt=0, le=1, description="max 1-IoU between neighbours in a cluster")
    dbscan_min_samples: int = Field(1, ge=1)
    min_box_size: float = Field(4.0, ge=0, description="boxes smaller than this (pixels) are dropped")
    max_detections: int = Field(100, ge=1)


class LossSpec(Section):
    coverage_weight: float = Field(1.0, gt=0)
    bbox_weight: float = Field(1.0, gt=0)
    positive_weight: float = Field(
        4.0, gt=0, description="weight of positive coverage cells; they are rare next to background"
    )
    coverage_normalizer: Literal["objects", "cells"] = Field(
        "objects", description="objects: the coverage loss summed and divided by the object cells, like the bbox "
        "loss, so each object's class signal keeps its weight whatever the grid size and number of classes; "
        "cells: averaged over every cell x class (TAO), which on 10 small-object classes left classes unlearnt "
        "(docs/design/recipe-notes.md)")
    class_weight: float = Field(
        1.0, ge=0, description="weight of a softmax cross-entropy over the class coverage logits at object cells, "
        "averaged over those cells and added to the coverage loss: it makes the classes compete where an object "
        "is, without moving coverage as a whole; 0 leaves TAO's per-class sigmoid loss alone "
        "(docs/design/recipe-notes.md)")

PIPELINE_PRETRAINED = "pipeline:pretrain"  # model.pretrained: the weights of the pipeline run's own pretrain stage
# model.pretrained's default: the default backbone (ResNet-10/0.5) pretrained by `qatpipe pretrain` on 8,000 synthetic
# images, shipped with the package (docs/pretrained.md has its card)
PACKAGED_START = "qatpipe:resnet10-0.5-shapes-photos"


class _ArchitectureSpec(Section):
    """What every architecture's model section has: where its backbone's weights start (docs/pretrained.md)."""

    pretrained: str | None = Field(
        PACKAGED_START, description="weights the backbone starts from, matched by layer name: a .keras or .h5 file (a "
        "path or s3://), e.g. qatpipe pretrain's weights.keras, or keras:imagenet (tf_keras.applications' "
        "ImageNet weights; mobilenet_v2 and efficientnet_b0), or pipeline:pretrain (in a pipeline run, the "
        "weights its pretrain stage writes; that stage runs only then), or qatpipe:<name> (a start shipped with "
        "the package, made by its own pretrain stage: docs/pretrained.md; the default, which fits only the default "
        "backbone). null: random weights")
    freeze_blocks: list[int] = Field(
        default_factory=list, description="backbone blocks whose weights stay as loaded in train and every "
        "retrain (TAO's freeze_blocks; each backbone's block numbers are in docs/pretrained.md)")
    freeze_bn: bool = Field(False, description="batch normalisation keeps its loaded statistics, scale and offset "
                                               "in every layer (TAO's freeze_bn)")

    @model_validator(mode="after")
    def _check_packaged_start(self) -> "_ArchitectureSpec":
        from qatpipe.weights import is_packaged, lookup

        if is_packaged(self.pretrained):  # a name the package lacks, or a start for another backbone, fails here
            try:
                lookup(self.pretrained, getattr(self, "backbone", None))
            except SpecError as exc:
                raise ValueError(str(exc).removeprefix("model.pretrained: ")) from None
        return self


class DetectNetV2Spec(_ArchitectureSpec):
    """The model section when model.arch is detectnet_v2: the backbone and regulariser any architecture has,
    and DetectNet_v2's own target encoder, decoder and loss (models/detectnet_v2.py)."""

    arch: Literal["detectnet_v2"] = "detectnet_v2"
    backbone: BackboneSpec = Field(default_factory=BackboneSpec)
    regularizer: RegularizerSpec = Field(default_factory=RegularizerSpec)
    target: TargetSpec = Field(default_factory=TargetSpec)
    decoder: DecoderSpec = Field(default_factory=DecoderSpec)
    loss: LossSpec = Field(default_factory=LossSpec)

    @property
    def size_multiple(self) -> int:
        """dataset.image_size must be a multiple of this: the output grid's stride."""
        return OUTPUT_STRIDE


# DetectNet_v2's output grid stride: dataset.image_size must be a multiple of it
OUTPUT_STRIDE = 16


# ---------------------------------------------------------------------------------------------- SSD


class SsdPriorSpec(Section):
    """SSD's feature maps and their prior (anchor) boxes, with TAO's keys (models/ssd.py, docs/ssd.md).

    One feature map per stride in `feature_strides`: the backbone's at 8 and 16, extra stride-2 layers above.
    A map's priors are centred on its cells; their size is scale x the image's shorter side, shaped by each
    aspect ratio (w/h); with two_boxes_for_ar1 a second square prior of sqrt(scale_k x scale_k+1) follows."""

    feature_strides: list[Literal[8, 16, 32, 64, 128]] = Field(
        default_factory=lambda: [8, 16, 32, 64], min_length=1,
        description="the maps' strides, increasing: 8 and 16 come from the backbone, larger ones from extra "
        "stride-2 layers")
    scales: list[float] = Field(
        default_factory=lambda: [0.08, 0.18, 0.36, 0.6, 0.9],
        description="prior size per map as a fraction of the image's shorter side, one per map plus one more "
        "(the last map's second ar-1 prior); increasing, in (0, 1]")
    aspect_ratios_global: list[float] = Field(
        default_factory=lambda: [1.0, 2.0, 0.5], description="prior width/height ratios of every map (TAO)")
    aspect_ratios: list[list[float]] | None = Field(
        None, description="per-map aspect ratios instead of aspect_ratios_global, one list per map (TAO)")
    two_boxes_for_ar1: bool = Field(True, description="a second, larger square prior per cell (TAO)")
    variances: list[float] = Field(
        default_factory=lambda: [0.1, 0.1, 0.2, 0.2], min_length=4, max_length=4,
        description="the box offsets' divisors: centre x, y, log width, log height (TAO)")
    clip_boxes: bool = Field(False, description="clip the priors to the image (TAO)")
    extra_filters: int = Field(256, ge=8, description="channels of the extra stride-2 layers")
    fpn: bool = Field(False, description="a top-down path: each map adds its upsampled coarser neighbour "
                                         "(SSD320 v1.2, RetinaNet)")
    fpn_filters: int = Field(128, ge=8, description="channels of every map when fpn is on")

    @model_validator(mode="after")
    def _check(self) -> "SsdPriorSpec":
        strides = self.feature_strides
        if strides != sorted(set(strides)):
            raise ValueError(f"feature_strides {strides} must increase without repeats")
        if len(self.scales) != len(strides) + 1:
            raise ValueError(f"scales has {len(self.scales)} values; feature_strides has {len(strides)} maps, so "
                             f"it needs {len(strides) + 1} (one per map and one more)")
        if any(not 0 < s <= 1 for s in self.scales) or self.scales != sorted(self.scales):
            raise ValueError(f"scales {self.scales} must increase within (0, 1]: a prior is a fraction of the "
                             "image's shorter side")
        ratio_lists = self.aspect_ratios or [self.aspect_ratios_global]
        if self.aspect_ratios is not None and len(self.aspect_ratios) != len(strides):
            raise ValueError(f"aspect_ratios has {len(self.aspect_ratios)} lists for {len(strides)} maps")
        for ratios in ratio_lists:
            if not ratios or any(not 1 / 8 <= r <= 8 for r in ratios):
                raise ValueError(f"aspect ratios {ratios} must be non-empty, each within [1/8, 8]")
        if any(v <= 0 for v in self.variances):
            raise ValueError(f"variances {self.variances} must be positive")
        return self

    def ratios_of(self, index: int) -> list[float]:
        return (self.aspect_ratios or [self.aspect_ratios_global] * len(self.feature_strides))[index]


class SsdTargetSpec(Section):
    """Ground truth -> per-prior targets: each object's best prior, and every prior above pos_iou_threshold."""

    pos_iou_threshold: float = Field(0.5, gt=0, le=1, description="priors at or above this IoU with an object "
                                                                   "regress it")
    neg_iou_limit: float = Field(0.4, gt=0, le=1, description="priors below this IoU with every object are "
                                 "background; between the two they are ignored")

    @model_validator(mode="after")
    def _check(self) -> "SsdTargetSpec":
        if self.neg_iou_limit > self.pos_iou_threshold:
            raise ValueError(f"neg_iou_limit {self.neg_iou_limit} > pos_iou_threshold {self.pos_iou_threshold}")
        return self


class SsdLossSpec(Section):
    type: Literal["hard_negative_mining", "focal"] = Field(
        "hard_negative_mining", description="hard_negative_mining: softmax cross-entropy on the positives and the "
        "neg_pos_ratio x as many hardest background priors (TAO); focal: focal loss on every prior (RetinaNet)")
    neg_pos_ratio: float = Field(3.0, gt=0, description="background priors kept per positive (TAO's 3)")
    alpha: float = Field(1.0, gt=0, description="weight of the smooth-L1 box loss (TAO's alpha)")
    focal_gamma: float = Field(2.0, ge=0)
    focal_alpha: float = Field(0.25, gt=0, lt=1, description="focal: the object classes' weight; background "
                                                              "gets 1 - focal_alpha")


class SsdDecoderSpec(Section):
    """Network outputs -> boxes: per class, confident priors, top-k, NMS; then the best max_detections."""

    confidence_threshold: float = Field(0.01, ge=0, le=1, description="low for mAP, like TAO's evaluation")
    top_k: int = Field(200, ge=1, description="candidates per class before NMS")
    nms_iou: float = Field(0.5, gt=0, le=1)
    max_detections: int = Field(100, ge=1)


class SsdSpec(_ArchitectureSpec):
    """The model section when model.arch is ssd: multi-scale heads on the backbone (models/ssd.py)."""

    arch: Literal["ssd"] = "ssd"
    backbone: BackboneSpec = Field(default_factory=BackboneSpec)
    regularizer: RegularizerSpec = Field(default_factory=RegularizerSpec)
    ssd: SsdPriorSpec = Field(default_factory=SsdPriorSpec)
    target: SsdTargetSpec = Field(default_factory=SsdTargetSpec)
    loss: SsdLossSpec = Field(default_factory=SsdLossSpec)
    decoder: SsdDecoderSpec = Field(default_factory=SsdDecoderSpec)

    @property
    def size_multiple(self) -> int:
        """the largest map's stride: the top-down path (fpn) doubles each map to its finer neighbour's size"""
        return max(self.ssd.feature_strides)


# ------------------------------------------------------------------------------------- the registry


@dataclass(frozen=True)
class Architecture:
    """One row of the architecture registry: the model section the spec validates `model:` with, and the
    DetectorArchitecture (qatpipe.models) that implements it, named as "module:class", not imported: it stands on
    the models floor above the spec, and loads TensorFlow (qatpipe.models.architecture_class imports it)."""

    section: type[_ArchitectureSpec]
    implementation: str


# model.arch -> its row: the one table of architectures. A new detector is its module in qatpipe.models (its
# DetectorArchitecture: model, targets, losses, decoder, decoding record, DeepStream layout, resume keys) and its
# section class above with its row here; nothing else in the library names an architecture (tests/test_arch_names.py)
ARCHITECTURES = {
    "detectnet_v2": Architecture(DetectNetV2Spec, "qatpipe.models.detectnet_v2:DetectNetV2"),
    "ssd": Architecture(SsdSpec, "qatpipe.models.ssd:SSD"),
}
# the model section is one of the architectures' own sections, picked by its `arch` (absent: DEFAULT_ARCH)
ARCHITECTURE_SPECS = {name: row.section for name, row in ARCHITECTURES.items()}
# DEFAULT_ARCH: of a spec that names no arch (the default recipe's; specs written before SSD came name no arch
# and meant detectnet_v2: they say so now)
DEFAULT_ARCH = "ssd"


def _arch(value: Any) -> str | None:
    return value.get("arch", DEFAULT_ARCH) if isinstance(value, dict) else getattr(value, "arch", None)


ModelSpec = Annotated[
    Union[tuple(Annotated[section, Tag(arch)] for arch, section in ARCHITECTURE_SPECS.items())],
    Discriminator(_arch, custom_error_type="unknown_architecture",
                  custom_error_message=f"model.arch must be one of: {', '.join(ARCHITECTURE_SPECS)}"),
]
