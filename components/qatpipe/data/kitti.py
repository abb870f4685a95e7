"""KITTI detection datasets in TAO's layout: `images/` + `labels/`, one 15-field line per object.

Every line is validated; a bad one is an error naming the file and line, never a silent skip, because a
skipped label silently turns a real object into background and corrupts both training and mAP.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping

import numpy as np
from PIL import Image, UnidentifiedImageError

from qatpipe.errors import DataError, shown

log = logging.getLogger(__name__)

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png")
# what tf.io.decode_image reads: an image Pillow opens but TensorFlow cannot would fail mid-training
DECODABLE_FORMATS = {"JPEG", "PNG", "BMP", "GIF", "WEBP"}
KITTI_FIELDS = 15  # type truncated occluded alpha x1 y1 x2 y2 h w l x y z rotation_y
_BBOX = slice(4, 8)


@dataclass(frozen=True)
class ClassMap:
    """Label names -> class ids. Case-insensitive, like TAO's KITTI reader."""

    classes: tuple[str, ...]
    mapping: Mapping[str, str]
    ignored: frozenset[str]

    @classmethod
    def create(
        cls, classes: Iterable[str], mapping: Mapping[str, str] | None = None, ignored: Iterable[str] = ()
    ) -> "ClassMap":
        return cls(
            classes=tuple(classes),
            mapping={k.lower(): v for k, v in (mapping or {}).items()},
            ignored=frozenset(name.lower() for name in ignored),
        )

    def class_id(self, name: str) -> int | None:
        """The id of a label name, None for an ignored name; KeyError for an unknown one."""
        key = name.lower()
        if key in self.ignored:
            return None
        target = self.mapping.get(key, name)
        for index, known in enumerate(self.classes):
            if known.lower() == target.lower():
                return index
        raise KeyError(name)


@dataclass(frozen=True)
class KittiSample:
    image_path: Path
    label_path: Path
    height: int
    width: int
    boxes: np.ndarray  # (N, 4) float32 x1 y1 x2 y2 in image pixels, clipped to the image
    classes: np.ndarray  # (N,) int32 class ids


def parse_label_file(
    path: Path, class_map: ClassMap, image_width: int, image_height: int, tolerance: float
) -> tuple[np.ndarray, np.ndarray]:
    """Parse and validate one KITTI label file. Returns (boxes, class ids)."""
    try:
        text = path.read_text(encoding="utf-8-sig")  # tolerate the BOM Windows editors write
    except FileNotFoundError:
        raise DataError(path, "label file not found") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(path, f"cannot read label file: {exc}") from None

    boxes: list[list[float]] = []
    class_ids: list[int] = []
    for line_no, line in enumerate(text.splitlines(), start=1):
        fields = line.split()
        if not fields:
            continue  # blank lines (trailing newline) carry no object
        if len(fields) != KITTI_FIELDS:
            raise DataError(path, f"expected {KITTI_FIELDS} KITTI fields, found {len(fields)}", line_no)
        try:
            numbers = [float(v) for v in fields[1:]]
        except ValueError:
            bad = next(v for v in fields[1:] if not _is_float(v))
            raise DataError(path, f"field {fields.index(bad, 1) + 1} is not a number: {_field(bad)}", line_no) from None
        if not all(math.isfinite(v) for v in numbers):
            bad = next(i for i, v in enumerate(numbers) if not math.isfinite(v))
            raise DataError(path, f"field {bad + 2} is not a finite number: {_field(fields[bad + 1])}", line_no)
        try:
            class_id = class_map.class_id(fields[0])
        except KeyError:
            raise DataError(
                path,
                f"unknown class {_field(fields[0])} (classes: {', '.join(class_map.classes)}; "
                "add it to dataset.classes, dataset.class_mapping or dataset.ignore_classes)",
                line_no,
            ) from None
        x1, y1, x2, y2 = numbers[_BBOX.start - 1 : _BBOX.stop - 1]
        if not (x1 < x2 and y1 < y2):
            raise DataError(path, f"degenerate box, need x1<x2 and y1<y2: {x1} {y1} {x2} {y2}", line_no)
        if x1 < -tolerance or y1 < -tolerance or x2 > image_width + tolerance or y2 > image_height + tolerance:
            raise DataError(
                path,
                f"box {x1} {y1} {x2} {y2} lies outside the {image_width}x{image_height} image "
                f"(tolerance {tolerance} px)",
                line_no,
            )
        if class_id is None:
            continue
        clipped = [min(max(x1, 0.0), image_width), min(max(y1, 0.0), image_height),
                   min(max(x2, 0.0), image_width), min(max(y2, 0.0), image_height)]
        if not (clipped[0] < clipped[2] and clipped[1] < clipped[3]):
            raise DataError(
                path, f"box {x1} {y1} {x2} {y2} has no area inside the {image_width}x{image_height} image", line_no
            )
        boxes.append(clipped)
        class_ids.append(class_id)
    return np.asarray(boxes, np.float32).reshape(-1, 4), np.asarray(class_ids, np.int32)


def _field(value: str) -> str:
    """One field of a data file as an error shows it: quoted, escaped, at most 40 characters."""
    return repr(value if len(value) <= 40 else value[:37] + "...")


def _is_float(value: str) -> bool:
    try:
        float(value)
        return True
    except ValueError:
        return False


def read_image_size(path: Path, verify: bool = True) -> tuple[int, int]:
    """(width, height) of an image; with verify, decode it fully so corrupt files fail here, not mid-training."""
    try:
        with Image.open(path) as image:
            size, kind = image.size, image.format
            if verify:
                image.load()
    except FileNotFoundError:
        raise DataError(path, "image file not found") from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as exc:
        raise DataError(path, f"corrupt or unreadable image: {exc}") from None
    if kind not in DECODABLE_FORMATS:
        raise DataError(path, f"{kind} image: the input pipeline reads {', '.join(sorted(DECODABLE_FORMATS))}")
    return size


def read_kitti_dataset(
    folder: str | Path,
    class_map: ClassMap,
    tolerance: float = 2.0,
    verify_images: bool = True,
    key: str = "dataset",
    follow_symlinks: bool = False,
) -> list[KittiSample]:
    """Read and validate a KITTI folder. `key` names the spec entry in errors (e.g. dataset.train). An image or
    label that resolves outside `folder` (a link) is refused unless `follow_symlinks`."""
    folder = Path(folder)
    images_dir, labels_dir = folder / "images", folder / "labels"
    if not folder.is_dir():
        raise DataError(folder, f"{key}: dataset folder not found")
    for sub in (images_dir, labels_dir):
        if not sub.is_dir():
            raise DataError(sub, f"{key}: missing folder (a KITTI dataset has images/ and labels/)")

    images = sorted(p for p in images_dir.iterdir() if p.suffix.lower() in IMAGE_EXTENSIONS)
    if not images:
        raise DataError(images_dir, f"{key}: no images ({', '.join(IMAGE_EXTENSIONS)})")
    stems: dict[str, Path] = {}
    for image in images:
        if image.stem in stems:
            raise DataError(image, f"{key}: {shown(stems[image.stem].name)} has the same name; each image needs its "
                                   "own label")
        stems[image.stem] = image
    orphans = sorted(p.name for p in labels_dir.glob("*.txt") if p.stem not in stems)
    if orphans:
        raise DataError(labels_dir / orphans[0], f"label file has no image ({len(orphans)} such files)")

    root = folder.resolve()
    samples = []
    for index, image_path in enumerate(images):
        label_path = labels_dir / f"{image_path.stem}.txt"
        if not label_path.is_file():
            raise DataError(label_path, f"label file not found for image {shown(image_path.name)}")
        if not follow_symlinks:
            check_inside(root, (image_path, label_path), key)
        width, height = read_image_size(image_path, verify=verify_images)
        boxes, classes = parse_label_file(label_path, class_map, width, height, tolerance)
        samples.append(KittiSample(image_path, label_path, height, width, boxes, classes))
        if (index + 1) % 2000 == 0:
            log.info("%s: checked %d/%d images", key, index + 1, len(images))
    log.info(
        "%s: %d images, %d objects (%s)", key, len(samples), sum(len(s.classes) for s in samples),
        ", ".join(f"{n}={c}" for n, c in zip(class_map.classes, class_counts(samples, len(class_map.classes)))),
    )
    return samples


def check_inside(root: Path, paths: tuple[Path, ...], key: str) -> None:
    """Refuse a file that resolves outside the data set folder `root` (resolved): a link must not make the
    pipeline read, and echo, files elsewhere on the machine."""
    for path in paths:
        if not path.resolve().is_relative_to(root):
            raise DataError(path, f"{key}: a link leading outside the data set folder {shown(root)}; copy the file in, "
                                  "or set dataset.follow_symlinks: true to read it")


def class_counts(samples: list[KittiSample], num_classes: int) -> list[int]:
    counts = np.zeros(num_classes, np.int64)
    for sample in samples:
        np.add.at(counts, sample.classes, 1)
    return counts.tolist()
