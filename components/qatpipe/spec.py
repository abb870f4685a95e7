"""The experiment spec: one YAML file, typed and validated, with TAO-like sections.

Every stage reads its settings from here; nothing else defines defaults. Unknown keys are errors
(`extra="forbid"`) so a typo never silently falls back to a default.
"""

from __future__ import annotations

import copy
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Callable, Iterable, Literal, Optional, Union, get_args

import yaml
from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationError, model_validator

from qatpipe.errors import SpecError


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


# ----------------------------------------------------------------------------------------------- dataset


class ImageSize(_Section):
    height: int = Field(192, ge=32, description="network input height (a multiple of the model's largest "
                                                "stride: 16 for detectnet_v2)")
    width: int = Field(320, ge=32, description="network input width (a multiple of the model's largest stride)")


class SyntheticDataSpec(_Section):
    """The embedded data set the pipeline generates when the spec names no train/val folders."""

    kind: Literal["shapes", "glyphs", "glyphs_shift", "photos", "traffic", "traffic_night"] = Field(
        "shapes", description="shapes: car/pedestrian/cyclist told apart by outline; glyphs: ten digits on tiles "
        "of one outline; glyphs_shift: glyphs whose val split is printed in fonts train never shows; photos: ten "
        "textures on real photographs (data/synth/detail.py); traffic: crowded street scenes of ten imbalanced "
        "vehicle-like classes, 16-80 px wide, occluded and truncated (data/synth/traffic.py); traffic_night: those "
        "scenes at night, dark, noisy and lit by saturating lamps (data/synth/night.py); dataset.classes must "
        "name the kind's classes")
    train_images: int = Field(2000, ge=1)
    val_images: int = Field(2000, ge=1, description="evaluate, validate and compare score all of them (about "
                            "1,900 give a paired CI of +-0.5 mAP points, README); validation during training "
                            "scores a fixed sample of train.val_images")
    seed: int = 0


class DatasetSpec(_Section):
    train: str | None = Field(
        None, description="KITTI folder (images/ + labels/): local path or s3://bucket/prefix; "
        "unset: the pipeline's prepare-data stage generates `synthetic` data"
    )
    val: str | None = Field(None, description="KITTI folder used for evaluation")
    synthetic: SyntheticDataSpec = Field(default_factory=SyntheticDataSpec)
    classes: list[str] = Field(min_length=1, description="class names; the order fixes the output channels")
    class_mapping: dict[str, str] = Field(
        default_factory=dict, description="label name -> class name (e.g. van: car); others must be in classes"
    )
    ignore_classes: list[str] = Field(
        default_factory=list, description="label names skipped on purpose (e.g. DontCare)"
    )
    image_size: ImageSize = Field(default_factory=ImageSize)
    box_tolerance_px: float = Field(2.0, ge=0, description="how far a box may stick out of its image")
    cache_dir: str = Field(".qatpipe-cache", description="local cache for s3:// datasets")
    max_boxes_per_image: int = Field(64, ge=1)
    follow_symlinks: bool = Field(
        False, description="read images and labels that are links leading outside their data set folder "
        "(refused by default)"
    )

    @model_validator(mode="after")
    def _check_classes(self) -> "DatasetSpec":
        # compared lower-cased: the KITTI reader (data/kitti.py ClassMap) matches names case-insensitively
        duplicates = _case_collisions(self.classes)
        if duplicates:
            raise ValueError(f"classes has duplicates (case-insensitive): {duplicates}")
        mapping_duplicates = _case_collisions(self.class_mapping)
        if mapping_duplicates:
            raise ValueError(f"class_mapping has keys that differ only in case: {mapping_duplicates}")
        classes = {name.lower() for name in self.classes}
        ignored = {name.lower() for name in self.ignore_classes}
        both = sorted(name for name in self.ignore_classes if name.lower() in classes)
        if both:
            raise ValueError(f"names in both classes and ignore_classes: {both}")
        unknown = sorted({target for target in self.class_mapping.values() if target.lower() not in classes})
        if unknown:
            raise ValueError(f"class_mapping maps to names not in classes: {unknown}")
        # the reader checks ignore_classes first, so such a mapping entry would never apply
        mapped_and_ignored = sorted(key for key in self.class_mapping if key.lower() in ignored)
        if mapped_and_ignored:
            raise ValueError(f"class_mapping keys also in ignore_classes: {mapped_and_ignored}")
        return self


def _case_collisions(names: Iterable[str]) -> list[list[str]]:
    """Groups of names that are equal when lower-cased, e.g. [['car', 'Car']]."""
    groups: dict[str, list[str]] = {}
    for name in names:
        groups.setdefault(name.lower(), []).append(name)
    return [group for group in groups.values() if len(group) > 1]


# ------------------------------------------------------------------------------------------------- model


class BackboneSpec(_Section):
    """The feature extractor under DetectNet_v2's heads, stride 16 whichever it is (models/backbones.py)."""

    name: str = Field("resnet", description="a backbone of models/backbones.py's registry (BACKBONES; an unknown "
                                            "name's error lists them)")
    depth: Literal[10, 18, 34] = Field(10, description="resnet only: 10, 18 or 34 layers")
    width: float = Field(1.0, gt=0, le=2.0, description="multiplier on every filter count (ResNet's 64-128-256-"
                                                        "512, MobileNetV2's alpha, EfficientNet's width)")
    all_projections: bool = Field(True, description="resnet only: 1x1 conv shortcut in every block (TAO default)")

    @model_validator(mode="after")
    def _check_name(self) -> "BackboneSpec":
        from qatpipe.models.backbones import BACKBONES

        if self.name not in BACKBONES:
            raise ValueError(f"name {self.name!r} is not a backbone: one of {', '.join(BACKBONES)}")
        return self


class RegularizerSpec(_Section):
    type: Literal["l1", "l2", "none"] = "l1"  # L1 drives filter norms to zero: makes pruning effective
    weight: float = Field(1e-5, ge=0)


class TargetSpec(_Section):
    """Ground truth -> coverage/bbox tensors (DetectNet_v2's target encoder)."""

    coverage_ratio: float = Field(
        0.6, gt=0, le=1,
        # narrow objects (pedestrians) get a single covered column at 0.4, too little training signal
        description="central fraction of each box (per side) whose cells get coverage 1",
    )
    bbox_norm: float = Field(35.0, gt=0, description="pixels per unit of the bbox regression targets")


class DecoderSpec(_Section):
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


class LossSpec(_Section):
    coverage_weight: float = Field(1.0, gt=0)
    bbox_weight: float = Field(1.0, gt=0)
    positive_weight: float = Field(
        4.0, gt=0, description="weight of positive coverage cells; they are rare next to background"
    )
    coverage_normalizer: Literal["objects", "cells"] = Field(
        "objects", description="objects: the coverage loss summed and divided by the object cells, like the bbox "
        "loss, so each object's class signal keeps its weight whatever the grid size and number of classes; "
        "cells: averaged over every cell x class (TAO), which on 10 small-object classes left classes unlearnt "
        "(docs/recipe.md)")
    class_weight: float = Field(
        1.0, ge=0, description="weight of a softmax cross-entropy over the class coverage logits at object cells, "
        "averaged over those cells and added to the coverage loss: it makes the classes compete where an object "
        "is, without moving coverage as a whole; 0 leaves TAO's per-class sigmoid loss alone (docs/recipe.md)")

PIPELINE_PRETRAINED = "pipeline:pretrain"  # model.pretrained: the weights of the pipeline run's own pretrain stage


class _ArchitectureSpec(_Section):
    """What every architecture's model section has: where its backbone's weights start (docs/pretrained.md)."""

    pretrained: str | None = Field(
        None, description="weights the backbone starts from, matched by layer name: a .keras or .h5 file (a "
        "path or s3://), e.g. qatpipe pretrain's weights.keras, or keras:imagenet (tf_keras.applications' "
        "ImageNet weights; mobilenet_v2 and efficientnet_b0), or pipeline:pretrain (in a pipeline run, the "
        "weights its pretrain stage writes; that stage runs only then), or qatpipe:<name> (a start shipped with "
        "the package, made by its own pretrain stage: docs/pretrained.md). None: random weights")
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


# ---------------------------------------------------------------------------------------------- SSD


class SsdPriorSpec(_Section):
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


class SsdTargetSpec(_Section):
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


class SsdLossSpec(_Section):
    type: Literal["hard_negative_mining", "focal"] = Field(
        "hard_negative_mining", description="hard_negative_mining: softmax cross-entropy on the positives and the "
        "neg_pos_ratio x as many hardest background priors (TAO); focal: focal loss on every prior (RetinaNet)")
    neg_pos_ratio: float = Field(3.0, gt=0, description="background priors kept per positive (TAO's 3)")
    alpha: float = Field(1.0, gt=0, description="weight of the smooth-L1 box loss (TAO's alpha)")
    focal_gamma: float = Field(2.0, ge=0)
    focal_alpha: float = Field(0.25, gt=0, lt=1, description="focal: the object classes' weight; background "
                                                              "gets 1 - focal_alpha")


class SsdDecoderSpec(_Section):
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


# The model section is one of the architectures' own sections, picked by its `arch` (absent: DEFAULT_ARCH):
# a new architecture adds its section class to ARCHITECTURE_SPECS, its package to qatpipe.models and its line
# to qatpipe.models.get_architecture's table; nothing else in the spec changes.
ARCHITECTURE_SPECS = {"detectnet_v2": DetectNetV2Spec, "ssd": SsdSpec}
# DEFAULT_ARCH: of a spec that names no arch, as every spec did before SSD came (the bundled default names ssd)
DEFAULT_ARCH = "detectnet_v2"


def _arch(value: Any) -> str | None:
    return value.get("arch", DEFAULT_ARCH) if isinstance(value, dict) else getattr(value, "arch", None)


ModelSpec = Annotated[
    Union[tuple(Annotated[section, Tag(arch)] for arch, section in ARCHITECTURE_SPECS.items())],
    Discriminator(_arch, custom_error_type="unknown_architecture",
                  custom_error_message=f"model.arch must be one of: {', '.join(ARCHITECTURE_SPECS)}"),
]


# ---------------------------------------------------------------------------------------- augmentation


class AugmentationSpec(_Section):
    hflip_prob: float = Field(0.5, ge=0, le=1)
    scale_min: float = Field(0.8, gt=0, description="zoom jitter: image scaled by a factor in [min, max]")
    scale_max: float = Field(1.2, gt=0)
    translate: float = Field(0.1, ge=0, le=0.5, description="max shift as a fraction of the image size")
    brightness: float = Field(0.15, ge=0, le=1)
    contrast: float = Field(0.2, ge=0, le=1)
    saturation: float = Field(0.2, ge=0, le=1)
    hue: float = Field(0.03, ge=0, le=0.5)
    min_visible_fraction: float = Field(
        0.5, ge=0, le=1, description="boxes cut by the crop to less than this fraction of their area are dropped"
    )

    @model_validator(mode="after")
    def _check_scale(self) -> "AugmentationSpec":
        if self.scale_min > self.scale_max:
            raise ValueError(f"scale_min ({self.scale_min}) > scale_max ({self.scale_max})")
        return self


# --------------------------------------------------------------------------------------------- training


class LearningRateSpec(_Section):
    """TAO's soft-start annealing schedule: log-linear ramp min->max, plateau, log-linear decay to min."""

    min_lr: float = Field(1e-5, gt=0)
    max_lr: float = Field(1e-3, gt=0)
    soft_start: float = Field(0.1, ge=0, lt=1, description="fraction of training spent ramping up")
    annealing_point: float = Field(0.7, gt=0, le=1, description="fraction of training where decay starts")

    @model_validator(mode="after")
    def _check_order(self) -> "LearningRateSpec":
        if self.min_lr > self.max_lr:
            raise ValueError(f"min_lr ({self.min_lr}) > max_lr ({self.max_lr})")
        if self.soft_start > self.annealing_point:
            raise ValueError(f"soft_start ({self.soft_start}) > annealing_point ({self.annealing_point})")
        return self


class TrainSpec(_Section):
    epochs: int = Field(20, ge=1)
    batch_size: int = Field(16, ge=1)
    seed: int = 42
    optimizer: Literal["adam", "sgd"] = "adam"
    momentum: float = Field(0.9, ge=0, lt=1, description="SGD momentum / Adam beta_1")
    learning_rate: LearningRateSpec = Field(default_factory=LearningRateSpec)
    checkpoint_interval: int = Field(1, ge=1, description="epochs between checkpoints")
    keep_checkpoints: int = Field(3, ge=1)
    validation_interval: int = Field(
        1, ge=0, description="epochs between validations on dataset.val during training (TAO's "
        "validation_period_during_training): val loss, mAP@0.5 and mAP@[.5:.95] as `evaluate` scores them, into "
        "training_log.csv and MLflow; the last epoch is always validated; 0: off (docs/recipe.md: why every epoch "
        "by default)")
    val_images: int | None = Field(
        300, ge=1, description="dataset.val images (a fixed seeded sample, the same every epoch and in every training "
        "stage) that validation during training scores; null: all of them. The final evaluations (evaluate, "
        "validate, compare) always score all of dataset.val")
    keep: Literal["best", "last"] = Field(
        "best", description="which weights become model.keras: those of the epoch with the best val mAP@0.5 "
        "(ties: the later epoch), or the last epoch's; without validation, the last")
    use_amp: bool = Field(False, description="mixed precision: float16 on a GPU, bfloat16 on a CPU with AMX-BF16 or "
                            "AVX512-BF16, else FP32 with a warning (training/precision.py; docs/scale-out.md)")
    log_every_n_steps: int = Field(25, ge=1)


class EvaluateSpec(_Section):
    batch_size: int = Field(16, ge=1)


# ---------------------------------------------------------------- later stages (room kept, typed now)


class PruneSpec(_Section):
    threshold: float = Field(0.1, ge=0, description="TAO's -pth: channels whose normalised norm is below it go")
    target_flops_ratio: float | None = Field(
        None, gt=0, le=1, description="instead of `threshold`: the lowest threshold that leaves at most this "
        "share of the model's FLOPs (the same threshold prunes models trained on other data to very different "
        "sizes); the threshold it found is in prune_report.json")
    normalizer: Literal["max", "L2"] = "max"
    granularity: int = Field(8, ge=1)
    min_filters: int = Field(16, ge=1)
    equalization: Literal["union", "intersection", "arithmetic_mean", "geometric_mean"] = "union"
    excluded_layers: list[str] = Field(default_factory=list)


class RetrainSpec(_Section):
    """Retraining of the pruned model (FP32 and QAT): the train section's settings, except these."""

    epochs: int | None = Field(None, ge=1, description="default: train.epochs")


class QatSpec(_Section):
    """Quantization-aware training for TensorRT (quantization/rules.py documents each placement rule)."""

    enabled: bool = Field(False, description="retrain with fake quantization (TAO's enable_qat)")
    start: Literal["pruned", "fp32", "baseline"] = Field(
        "baseline", description="where QAT starts. baseline (the default; the textbook order, PyTorch's and "
        "TensorRT's QAT guides): the FP32 baseline is the FP32 retrain's model fine-tuned for finetune_epochs, and "
        "QAT fine-tunes that baseline itself, briefly (epochs, learning_rate), so PTQ and QAT quantize the same FP32 "
        "weights; retrain-qat waits for finetune-fp32. fp32 (NVIDIA's QAT toolkit's order): QAT fine-tunes the FP32 "
        "retrain's model beside the baseline, as long, so both have had the same training. pruned (TAO's order): the "
        "pruned model, for retrain.epochs, like the FP32 retrain, which is then the baseline (docs/quantization.md: "
        "the orders measured)")
    finetune_epochs: int | None = Field(
        None, ge=0, description="start: fp32 and baseline: the epochs of the FP32 baseline's fine-tuning (under fp32 "
        "also of the QAT fine-tuning beside it); default retrain.epochs. 0 (start: baseline only): no second FP32 "
        "training, the FP32 retrain's model is the baseline that PTQ quantizes and QAT fine-tunes")
    finetune_learning_rate: LearningRateSpec | None = Field(
        None, description="start: fp32 and baseline: the learning-rate schedule of the FP32 baseline's fine-tuning "
        "(under fp32 also of the QAT fine-tuning beside it; they start from a trained model, which "
        "train.learning_rate's peak first knocks back; bench/README.md finetune.py: shorter, gentler fine-tunings "
        "lost mAP). Default train.learning_rate; keys left out of it take the schedule's own defaults, not train's")
    epochs: int = Field(2, ge=1, description="start: baseline: the epochs QAT fine-tunes the FP32 baseline "
                        "(PyTorch's and NVIDIA's QAT guides: a small fraction of the training)")
    learning_rate: LearningRateSpec = Field(
        default_factory=lambda: LearningRateSpec(min_lr=1e-6, max_lr=2e-4, soft_start=0.1, annealing_point=0.6),
        description="start: baseline: the learning-rate schedule of that QAT fine-tuning (a converged model: about "
        "a tenth of the default train.learning_rate's peak; the guides: 1-10% of the training's)")
    calibration_batches: int = Field(8, ge=1, description="training batches that initialise activation ranges")
    ema_decay: float = Field(0.999, ge=0, lt=1, description="moving average of activation ranges in training")
    bn_update_epochs: int | None = Field(
        None, ge=0, description="BatchNormalization updates its moving statistics in the first N epochs of the QAT "
        "retrain only; after them it normalises with those statistics, as the exported model does, while its scale "
        "and offset keep training (PyTorch's freeze_bn_stats; torchvision's QAT recipe: 3). None: every epoch "
        "(quantization/freeze.py)")
    range_update_epochs: int | None = Field(
        None, ge=0, description="activation ranges follow their moving average (ema_decay) in the first N epochs "
        "of the QAT retrain only; after them they stay as they are (PyTorch's disable_observer; torchvision's QAT "
        "recipe: 4). None: every epoch; 0: the calibrated ranges throughout")
    excluded_layers: Union[Literal["auto"], list[str]] = Field(
        default_factory=list, description="layer names kept in float; or auto: the layers partial PTQ keeps float "
        "in the FP32 model QAT starts from (its PTQ, that model's layer sensitivity, then ptq.keep_float auto's "
        "search to validate.max_map_drop; stages/retrain.py, docs/quantization.md), resolved by the QAT retrain")
    excluded_layer_types: list[str] = Field(default_factory=list, description="layer classes kept in float, e.g. Dense")
    quantize_outputs: list[str] = Field(
        default_factory=list, description="model outputs given Q/DQ too; none by default (TAO: a quantized bbox "
        "output ruins detection)")
    relu6: bool = Field(False, description="replace ReLU by ReLU6 before QAT (TAO-style)")
    distill_weight: float = Field(
        0.0, ge=0, description="distillation during QAT: the weight of a loss that pulls the QAT model's outputs "
        "towards those of its FP32 teacher, added to the task loss. The teacher is the model QAT starts from (start "
        "fp32: the FP32 retrain's; start baseline: the FP32 baseline; start pruned: the pruned model), frozen, run in inference mode on the same "
        "augmented batch; train time only, the exported model is unchanged. 0: off, the default until a bench/ "
        "measurement decides (docs/quantization.md: Distillation)")

    @model_validator(mode="after")
    def _check_finetune(self) -> "QatSpec":
        if self.finetune_epochs == 0 and self.start != "baseline":
            raise ValueError(f"finetune_epochs 0 (no FP32 fine-tuning) needs start: baseline; under start {self.start} "
                             "QAT fine-tunes for finetune_epochs too")
        return self


class PtqSpec(_Section):
    """Post-training quantization of the FP32 model (the baseline QAT must beat): Q/DQ format, symmetric int8
    activations and per-channel weights, by ONNX Runtime's static quantization or NVIDIA Model Optimizer's ONNX
    quantizer (`tool`)."""

    tool: Literal["onnxruntime", "modelopt"] = Field(
        "onnxruntime", description="onnxruntime: ONNX Runtime's quantize_static; "
        "modelopt: NVIDIA Model Optimizer's ONNX INT8 PTQ (modelopt.onnx.quantization), TensorRT's own tooling, "
        "calibrated on CPU in its own environment (quantization/modelopt_ptq.py; `make modelopt`)")
    calibration_images: int = Field(200, ge=1, description="training images the ranges are calibrated on")
    method: Optional[Literal["entropy", "percentile", "minmax"]] = Field(
        None, description="the calibration method; unset: the tool's default, percentile for onnxruntime, entropy "
        "for modelopt (TensorRT's calibrator; modelopt has no percentile); docs/quantization.md: why")
    percentile: float = Field(99.99, gt=90, le=100, description="for method: percentile")
    seed: int = 0
    report_images: int = Field(16, ge=0, description="calibration images of the precision report (FP16 flags, "
                               "the INT8 model against FP32 layer by layer); 0: no report")
    keep_float: Union[Literal["auto"], list[str]] = Field(
        "auto", description="the ptq-partial variant (stages/ptq_partial.py): layers of the PTQ model kept float. "
        "auto: the most sensitive (the sensitivity stage's ranking, then the layers it did not score), fewest "
        "first, until the model scores within validate.max_map_drop of FP32 on the sensitivity val sample; or a "
        "list of layer / ONNX node names")

    @model_validator(mode="after")
    def _check_method(self) -> "PtqSpec":
        if self.tool == "modelopt" and self.method == "percentile":
            raise ValueError("tool modelopt calibrates by entropy or minmax (its 'max'); it has no percentile method")
        return self

    @property
    def calibration_method(self) -> str:
        """`method`, or the tool's default when it is unset."""
        return self.method or PTQ_DEFAULT_METHODS[self.tool]


PTQ_DEFAULT_METHODS = {"onnxruntime": "percentile", "modelopt": "entropy"}


class SensitivitySpec(_Section):
    """Layer sensitivity of a Q/DQ model (`qatpipe sensitivity`; quantization/sensitivity.py, docs/sensitivity.md):
    per quantizable layer, the mAP@0.5 drop with only it INT8 and with every layer but it INT8."""

    val_images: int = Field(100, ge=1, description="dataset.val images (a seeded sample) every variant is scored "
                            "on; two variants per layer, so the time grows with layers x images")
    max_layers: int = Field(32, ge=1, description="score at most this many layers: where the model has more, those "
                            "whose quantizers (input, weight, output requantization) add the most noise on one "
                            "batch")
    layers: list[str] = Field(default_factory=list, description="the layers to score, by ONNX node name (or the "
                              "layer name the report shows); empty: every quantizable layer")
    seed: int = 0


class ExportSpec(_Section):
    opset: int = Field(17, ge=13)
    calibration_cache_trt_version: int = Field(
        100300, description="TensorRT version in the QAT calibration cache header, as NV_TENSORRT_VERSION "
        "(10.3.0 -> 100300, DeepStream 7.1; 8.6.1 -> 8601)")
    fp16_onnx: bool = Field(
        True, description="also write <stem>_fp16.onnx: the float regions in FP16 through explicit casts (the only "
        "FP16 a strongly typed TensorRT 11 build has), the output tail after the last compute layer and every tensor "
        "the FP16 guard flags kept FP32; with "
        "precision_report.json/.md beside it")
    fp16_images: int = Field(16, ge=1, description="training images (a seeded sample) the FP16 guard records "
                             "ranges on and the FP16 form is compared on, layer by layer")
    target: Literal["gpu", "dla"] = Field(
        "gpu", description="dla: the QAT export also writes <stem>_dla.onnx (fixed batch, NCHW input) and "
        "<stem>_dla.cache, a scale for every tensor (the QAT model's where it has them, the rest calibrated: TAO's "
        "force_ptq), and dla_report.md (which layers fall back to the GPU, and why); engines on TensorRT 10 are "
        "then built for Jetson Orin's DLA (export/dla.py)")
    dla_batch: int = Field(1, ge=1, description="target dla: the fixed batch of the DLA form (DLA has no dynamic "
                           "shapes; DeepStream's batch-size)")
    dla_calibration_images: int = Field(64, ge=1, description="target dla: training images (a seeded sample) the "
                                        "tensors without a QAT scale are calibrated on")
    dla_calibration_method: Literal["percentile", "entropy", "minmax"] = Field(
        "percentile", description="target dla: how those tensors are calibrated (ONNX Runtime's calibrator, as "
        "PTQ; percentile at PTQ's default 99.99th; docs/deployment.md: why)")


class EngineBenchSpec(_Section):
    """The latency harness (`qatpipe bench-engine`): the same for every backend."""

    batch_sizes: list[int] = Field(default_factory=lambda: [1, 8], min_length=1)
    warmup: int = Field(10, ge=0, description="untimed runs first")
    iterations: int = Field(50, ge=1, description="timed runs, at least")
    min_seconds: float = Field(2.0, ge=0, description="and at least this long")


class EngineSpec(_Section):
    """Engine build: TensorRT with a GPU, ONNX Runtime anywhere (`auto` picks)."""

    backend: str = Field("auto", description="auto, or a backend of engines/__init__.py's BACKENDS (tensorrt, "
                                             "onnxruntime)")
    min_batch: int = Field(1, ge=1, description="TensorRT optimisation profile for the dynamic batch")
    opt_batch: int = Field(8, ge=1)
    max_batch: int = Field(16, ge=1)
    workspace_mb: int = Field(2048, ge=64, description="TensorRT builder workspace limit")
    fp16: bool = Field(True, description="the FP32 model in FP16 on TensorRT 10 (TensorRT 11: TF32)")
    dla_core: int = Field(0, ge=0, description="an export for DLA (export.target: dla): the DLA core TensorRT and "
                          "DeepStream use (Orin has two: 0 and 1)")
    gpu_fallback: bool = Field(True, description="an export for DLA: layers DLA cannot run go to the GPU (off: "
                               "the build fails on them)")
    cpu_form: Literal["auto", "exact", "fast"] = Field(
        "auto", description="ONNX Runtime CPU engine of a Q/DQ model: fast (BN folded, ReLU absorbed: integer "
        "kernels; engines/cpu_qdq.py) or exact (TensorRT's numbers, mostly float kernels); auto: fast where the "
        "CPU's int8 dot products cannot saturate (VNNI, AMX; not an x86 CPU), else exact; validate scores a fast "
        "engine's exact form too, as map50_tensorrt_emulated")
    bench: EngineBenchSpec = Field(default_factory=EngineBenchSpec)

    @model_validator(mode="after")
    def _check_profile(self) -> "EngineSpec":
        if not self.min_batch <= self.opt_batch <= self.max_batch:
            raise ValueError(f"engine: need min_batch <= opt_batch <= max_batch, got {self.min_batch}, "
                             f"{self.opt_batch}, {self.max_batch}")
        return self

    @model_validator(mode="after")
    def _check_backend(self) -> "EngineSpec":
        from qatpipe.engines import BACKENDS

        if self.backend != "auto" and self.backend not in BACKENDS:
            raise ValueError(f"backend {self.backend!r} is not an engine backend: one of auto, {', '.join(BACKENDS)}")
        return self


class PretrainSpec(_Section):
    """qatpipe pretrain: the backbone trained as a classifier of object crops (and background crops) or of a
    class-per-folder image tree; model.pretrained takes the weights it writes (stages/pretrain.py,
    docs/pretrain.md)."""

    data: list[str] = Field(
        default_factory=list, description="KITTI folders (each labelled object cropped) or class-per-folder image "
        "trees, local or s3://; empty: the spec's dataset.train")
    crop_size: int = Field(64, ge=32, multiple_of=32, description="crops are resized to this square, a multiple "
                           "of 32")
    crop_margin: float = Field(0.1, ge=0, le=1, description="an object's box grows by this fraction of its width "
                               "and height on each side before it is cropped (context around the object)")
    min_box_size: float = Field(8.0, ge=1, description="objects whose box has a side shorter than this (pixels) "
                                "are not cropped")
    background_crops: int = Field(1, ge=0, description="random crops per KITTI image, class `background`, each of "
                                  "the size of one of the data set's objects and overlapping no labelled box")
    background_max_iou: float = Field(0.1, ge=0, lt=1, description="a background crop's largest IoU with any "
                                      "labelled box")
    epochs: int = Field(8, ge=1)
    batch_size: int = Field(64, ge=1)
    learning_rate: float = Field(1e-3, gt=0, description="Adam's peak learning rate, in train's soft-start "
                                 "annealing schedule: up from 1/100 of it over the first 10% of the steps, down "
                                 "again from 70%")
    val_fraction: float = Field(0.1, gt=0, lt=1, description="share of the images whose crops are held back for "
                                "the top-1 figure")
    use_amp: bool = Field(False, description="mixed precision, as train.use_amp")
    seed: int = 0


class ValidateSpec(_Section):
    max_map_drop: float = Field(0.01, ge=0, description="largest allowed mAP@0.5 drop vs FP32 (0.01 = 1 point)")


class TrackingSpec(_Section):
    experiment: str = "qatpipe"
    registered_model: str | None = Field(None, description="MLflow registry name of the validated model; None: "
                                                           "qatpipe-<model.arch> (qatpipe-detectnet-v2, qatpipe-ssd)")
    champion_alias: str = Field("champion", pattern=r"^[A-Za-z][\w-]*$",
                                description="registry alias of the QAT version that passed the gate (the one it "
                                            "replaces keeps previous-<alias>; a failed one gets challenger)")


# ------------------------------------------------------------------------------------------------ root


class ExperimentSpec(_Section):
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


OUTPUT_STRIDE = 16


# -------------------------------------------------------------------------------------- load / override


def bundled_spec_path(name: str) -> Path:
    """Path of a spec shipped with the package (`default`, `full`, `tiny`)."""
    folder = Path(str(resources.files("qatpipe") / "specs"))
    path = folder / f"{name}.yaml"
    if not path.is_file():
        names = ", ".join(sorted(p.stem for p in folder.glob("*.yaml")))
        raise SpecError(f"no bundled spec named {name!r}: the bundled ones are {names} (or give a spec file's path)")
    return path


def _parse_override(item: str) -> tuple[list[str], Any]:
    if "=" not in item:
        raise SpecError(f"--set {item!r}: expected KEY.PATH=VALUE")
    key, raw = item.split("=", 1)
    keys = [k for k in key.strip().split(".") if k]
    if not keys:
        raise SpecError(f"--set {item!r}: empty key")
    try:
        value = yaml.safe_load(raw)  # '3' -> 3, 'true' -> True, '[a, b]' -> list
    except yaml.YAMLError as exc:
        raise SpecError(f"--set {item!r}: value is not valid YAML: {exc}") from exc
    return keys, value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Return a copy of `data` with `a.b.c=value` overrides applied."""
    data = copy.deepcopy(data)
    for item in overrides:
        keys, value = _parse_override(item)
        node = data
        for depth, key in enumerate(keys[:-1]):
            child = node.get(key)
            if child is None:
                child = node[key] = {}
            if not isinstance(child, dict):
                raise SpecError(f"--set {item!r}: {'.'.join(keys[: depth + 1])} is not a section")
            node = child
        node[keys[-1]] = value
    return data


def _format_validation_error(source: str, exc: ValidationError) -> str:
    lines = [f"{source}: invalid spec"]
    for err in exc.errors():
        parts = list(err["loc"])
        if parts[:1] == ["model"] and len(parts) > 1 and parts[1] in ARCHITECTURE_SPECS:
            del parts[1]  # the union's tag (model.arch), not a key of the spec
        loc = ".".join(str(part) for part in parts) or "<root>"
        loc = loc.replace("validate_", "validate")
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = "unknown key"
        elif err["type"] == "missing":
            msg = "required key is missing"
        lines.append(f"  {loc}: {msg}")
    return "\n".join(lines)


def parse_spec(data: dict[str, Any], source: str = "<spec>") -> ExperimentSpec:
    if not isinstance(data, dict):
        raise SpecError(f"{source}: the spec must be a YAML mapping, got {type(data).__name__}")
    try:
        return ExperimentSpec.model_validate(data)
    except ValidationError as exc:
        raise SpecError(_format_validation_error(source, exc)) from None


class _DuplicateKeyError(yaml.YAMLError):
    def __init__(self, key: Any, line: int, first_line: int):
        super().__init__(f"duplicate key {key!r} at line {line}")
        self.key, self.line, self.first_line = key, line, first_line


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate mapping keys, which plain YAML lets silently override."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        first_lines: dict[Any, int] = {}
        for key_node, _ in node.value:
            # `<<` merge keys are allowed to be overridden by explicit keys: checked before merging
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node)
            line = key_node.start_mark.line + 1  # marks count from 0
            if key in first_lines:
                raise _DuplicateKeyError(key, line, first_lines[key])
            first_lines[key] = line
        return super().construct_mapping(node, deep=deep)


def load_spec(path: str | Path, overrides: list[str] | None = None) -> ExperimentSpec:
    """Read, override and validate a spec file. Errors name the file and the key."""
    path = Path(path)
    if not path.is_file():
        raise SpecError(f"{path}: spec file not found")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise SpecError(f"{path}: not a UTF-8 text file") from None
    except OSError as exc:
        raise SpecError(f"{path}: cannot read the spec file: {exc.strerror or exc}") from None
    return load_spec_text(text, overrides, source=str(path))


def load_spec_text(text: str, overrides: list[str] | None = None, source: str = "<spec>") -> ExperimentSpec:
    """Parse, override and validate spec YAML text; `source` names it in errors."""
    path = source
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)
    except _DuplicateKeyError as exc:
        raise SpecError(
            f"{path}:{exc.line}: duplicate key {exc.key!r} (first at line {exc.first_line})"
        ) from None
    except yaml.YAMLError as exc:
        raise SpecError(f"{path}: not valid YAML: {exc}") from None
    if data is None:  # an empty file: parse_spec names the missing keys
        data = {}
    if overrides and isinstance(data, dict):  # a non-mapping is reported by parse_spec
        data = apply_overrides(data, overrides)
    return parse_spec(data, source=str(path))


def dump_spec(spec: ExperimentSpec, path: str | Path) -> None:
    from qatpipe.fileio import atomic_write_text

    atomic_write_text(path, spec_to_yaml(spec))


def spec_to_yaml(spec: ExperimentSpec) -> str:
    return yaml.safe_dump(spec.to_dict(), sort_keys=False)


def flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{'a': {'b': 1}} -> {'a.b': 1}: for experiment trackers' flat params."""
    flat: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat


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


def field_default(section: type[BaseModel], name: str) -> Any:
    """A spec field's default, for code that takes the setting outside a spec (a CLI flag, a layer argument):
    the spec stays the one home of every default."""
    return section.model_fields[name].get_default(call_default_factory=True)


def field_choices(section: type[BaseModel], name: str) -> tuple[str, ...]:
    """The values a Literal spec field allows, for a CLI flag's choices."""
    return get_args(section.model_fields[name].annotation)


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
    return yaml.safe_dump({key: full[key] for key in sections}, sort_keys=False)
