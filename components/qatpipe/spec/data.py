"""The dataset section: where the images are (or which synthetic set the pipeline makes), their classes and size."""

from __future__ import annotations

from typing import Iterable, Literal

from pydantic import Field, model_validator

from qatpipe.spec.base import Section


class ImageSize(Section):
    height: int = Field(192, ge=32, description="network input height (a multiple of the model's largest "
                                                "stride: 16 for detectnet_v2)")
    width: int = Field(320, ge=32, description="network input width (a multiple of the model's largest stride)")


class SyntheticDataSpec(Section):
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


class DatasetSpec(Section):
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
        default_factory=lambda: ["DontCare"], description="label names skipped on purpose (KITTI's DontCare: "
        "regions nobody labelled)"
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
