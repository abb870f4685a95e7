"""Stage: pretraining the backbone as an image classifier (`qatpipe pretrain`), as TAO's detectors start from
pretrained backbones.

The classifier is `input -> the spec's backbone -> GlobalAveragePooling2D -> Dense(classes)`, its backbone built
by the same call that builds the detector's (models/backbones.py), so every backbone layer has the name and the
weight shapes it has in the detector: model.pretrained loads `weights.keras` by layer name (docs/pretrain.md).

Data: each entry of pretrain.data (none: dataset.train), local or s3://, is either
- a KITTI folder (images/ + labels/, read by the KITTI reader with its checks): every labelled object at least
  pretrain.min_box_size pixels on a side is cropped with a margin around it, and each image gives
  pretrain.background_crops random crops of the size of one of the data set's objects that overlap no labelled
  box (IoU below pretrain.background_max_iou), class `background`; or
- a class-per-folder tree (ImageNet's layout): each subfolder is a class, its images (also in deeper folders) are
  that class's crops, whole.
Label and folder names go through dataset.class_mapping and dataset.ignore_classes (and KITTI's DontCare is never
a class); the classes are the data sets' names, dataset.classes' first in their order, then the others
alphabetically, then `background`. The crops of a share (pretrain.val_fraction) of the images, picked with
pretrain.seed, are held back: their top-1 accuracy is the stage's figure.
"""

from __future__ import annotations

import logging
import math
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from qatpipe.boxes import iou_matrix
from qatpipe.data.kitti import IMAGE_EXTENSIONS, ClassMap, check_inside, read_image_size, read_kitti_dataset
from qatpipe.storage import resolve_dataset_dir
from qatpipe.errors import DataError, QatpipeError, SpecError, shown
from qatpipe.fileio import write_json
from qatpipe.spec import STAGE_SECTIONS, ExperimentSpec, dump_spec, flatten

log = logging.getLogger(__name__)

WEIGHTS_FILE = "weights.keras"
CLASSES_FILE = "classes.json"
SUMMARY_FILE = "pretrain_summary.json"
LOG_FILE = "pretrain_log.csv"
SPEC_FILE = "spec.yaml"
STAGE = "pretrain"

BACKGROUND = "background"
# the classifier's own layers on top of the backbone: the only ones the detector does not have
POOL_LAYER = "pretrain_pool"
LOGITS_LAYER = "pretrain_logits"
HEAD_LAYERS = (POOL_LAYER, LOGITS_LAYER)
IGNORED_ALWAYS = ("dontcare",)  # KITTI's regions nobody labelled: never a class, never background

# the schedule's shape (train's soft-start annealing): from LR_START x pretrain.learning_rate up over the first
# SOFT_START of the steps, held, annealed back down from ANNEALING_POINT
LR_START, SOFT_START, ANNEALING_POINT = 0.01, 0.1, 0.7
BACKGROUND_TRIES = 20  # random boxes tried per background crop before the image gives none
CACHE_BYTES = 1 << 30  # crops (uint8) kept in memory after the first epoch when they fit in this
COLOUR_JITTER = {"brightness": 0.1, "contrast": 0.15, "saturation": 0.15, "hue": 0.02}


@dataclass(frozen=True)
class Crop:
    """One classifier example: a box of an image (normalised y1 x1 y2 x2, tf.image.crop_and_resize's order; the
    whole image for a class-per-folder tree) and its class name."""

    image: str
    box: tuple[float, float, float, float]
    label: str


@dataclass(frozen=True)
class Source:
    """The crops of one data entry."""

    data: str  # the entry as the spec names it
    kind: str  # "kitti" or "folders"
    images: int
    crops: list[Crop]


# ---------------------------------------------------------------------------------------------------- data


class _OpenClassMap(ClassMap):
    """The KITTI reader's class map with an open vocabulary: a label name that is not a class yet becomes one
    (appended to `classes`, a list here), after dataset.class_mapping and dataset.ignore_classes."""

    def class_id(self, name: str) -> int | None:
        try:
            return super().class_id(name)
        except KeyError:
            self.classes.append(self.mapping.get(name.lower(), name))
            return len(self.classes) - 1


def _class_map(spec: ExperimentSpec) -> _OpenClassMap:
    ds = spec.dataset
    base = ClassMap.create(ds.classes, ds.class_mapping, [*ds.ignore_classes, *IGNORED_ALWAYS])
    return _OpenClassMap(list(base.classes), base.mapping, base.ignored)


def data_entries(spec: ExperimentSpec) -> list[tuple[str, str]]:
    """(spec key, data URI) of each data set the stage reads: pretrain.data's, else dataset.train."""
    if spec.pretrain.data:
        return [(f"pretrain.data[{index}]", uri) for index, uri in enumerate(spec.pretrain.data)]
    if spec.dataset.train is None:
        raise SpecError("pretrain.data is empty and dataset.train is not set: name the data sets to pretrain on "
                        "(--set pretrain.data=[PATH,...]) or a KITTI folder in dataset.train")
    return [("dataset.train", spec.dataset.train)]


def is_kitti_folder(folder: Path) -> bool:
    """A KITTI folder has images/ and labels/ (the reader's errors say which one is missing); anything else is
    read as a class-per-folder tree."""
    return (folder / "images").is_dir() or (folder / "labels").is_dir()


def read_source(spec: ExperimentSpec, key: str, uri: str) -> Source:
    """The crops of one data entry (an s3:// one synced into dataset.cache_dir first)."""
    folder = resolve_dataset_dir(uri, spec.dataset.cache_dir)
    if not folder.is_dir():
        raise DataError(folder, f"{key}: data set folder not found")
    if is_kitti_folder(folder):
        images, crops = kitti_crops(folder, spec, key)
        return Source(uri, "kitti", images, crops)
    crops = folder_crops(folder, spec, key)
    return Source(uri, "folders", len(crops), crops)


def _grown(box: np.ndarray, margin: float, width: int, height: int) -> np.ndarray:
    x1, y1, x2, y2 = box
    dx, dy = (x2 - x1) * margin, (y2 - y1) * margin
    return np.array([max(x1 - dx, 0.0), max(y1 - dy, 0.0), min(x2 + dx, width), min(y2 + dy, height)])


def _normalised(box, width: int, height: int) -> tuple[float, float, float, float]:
    x1, y1, x2, y2 = (float(v) for v in box)
    return (y1 / height, x1 / width, y2 / height, x2 / width)


def box_iou(box: np.ndarray, boxes: np.ndarray) -> np.ndarray:
    """IoU of one x1 y1 x2 y2 box with each of `boxes` (N, 4)."""
    return iou_matrix(np.asarray(box, np.float64)[None], np.asarray(boxes, np.float64).reshape(-1, 4))[0]


def kitti_crops(folder: Path, spec: ExperimentSpec, key: str) -> tuple[int, list[Crop]]:
    """(images, crops) of a KITTI folder: its objects with a margin, and background crops."""
    settings = spec.pretrain
    class_map = _class_map(spec)
    samples = read_kitti_dataset(folder, class_map, spec.dataset.box_tolerance_px, key=key,
                                 follow_symlinks=spec.dataset.follow_symlinks)
    crops: list[Crop] = []
    sizes = []  # (w, h) of every object cropped: the sizes background crops take
    for sample in samples:
        for box, class_id in zip(sample.boxes, sample.classes):
            w, h = box[2] - box[0], box[3] - box[1]
            if min(w, h) < settings.min_box_size:
                continue
            grown = _grown(box, settings.crop_margin, sample.width, sample.height)
            crops.append(Crop(str(sample.image_path), _normalised(grown, sample.width, sample.height),
                              class_map.classes[class_id]))
            sizes.append(((grown[2] - grown[0]), (grown[3] - grown[1])))
    if not crops:
        objects = sum(len(sample.classes) for sample in samples)
        raise DataError(folder, f"{key}: no labelled objects to crop ({objects} objects, none with both box sides "
                                f"at least pretrain.min_box_size={settings.min_box_size:g} px)")
    rng = np.random.default_rng([settings.seed, len(samples)])
    backgrounds = 0
    for sample in samples:
        for _ in range(settings.background_crops):
            box = _background_box(rng, sample, sizes, settings.background_max_iou)
            if box is not None:
                crops.append(Crop(str(sample.image_path), _normalised(box, sample.width, sample.height), BACKGROUND))
                backgrounds += 1
    log.info("%s: %d object crops, %d background crops from %d images", key, len(crops) - backgrounds, backgrounds,
             len(samples))
    return len(samples), crops


def _background_box(rng, sample, sizes, max_iou: float) -> np.ndarray | None:
    """A random box of one of `sizes` (fitted into the image) overlapping no labelled box of `sample` by
    `max_iou` or more; None when BACKGROUND_TRIES boxes all did."""
    for _ in range(BACKGROUND_TRIES):
        w, h = sizes[int(rng.integers(len(sizes)))]
        w, h = min(w, sample.width), min(h, sample.height)
        x1 = rng.uniform(0, sample.width - w)
        y1 = rng.uniform(0, sample.height - h)
        box = np.array([x1, y1, x1 + w, y1 + h])
        if not len(sample.boxes) or box_iou(box, sample.boxes).max() < max_iou:
            return box
    return None


def folder_crops(folder: Path, spec: ExperimentSpec, key: str) -> list[Crop]:
    """A class-per-folder tree: each image of each subfolder (at any depth) whole, of the subfolder's class.
    Every image is decoded once here, so a corrupt one fails now, named, not in the middle of training."""
    class_map = _class_map(spec)
    root = folder.resolve()
    found: list[tuple[Path, str]] = []
    subfolders = sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))
    for sub in subfolders:
        class_id = class_map.class_id(sub.name)
        if class_id is None:
            continue
        images = sorted(p for p in sub.rglob("*") if p.suffix.lower() in IMAGE_EXTENSIONS and p.is_file())
        found += [(path, class_map.classes[class_id]) for path in images]
    if not found:
        loose = [p for p in folder.iterdir() if p.suffix.lower() in IMAGE_EXTENSIONS]
        hint = (f"its {len(loose)} images lie in the folder itself: a class-per-folder tree has one subfolder per "
                "class" if loose else f"neither a KITTI folder (images/, labels/) nor a class-per-folder tree with "
                f"images ({', '.join(IMAGE_EXTENSIONS)}) in its subfolders")
        raise DataError(folder, f"{key}: no images: {hint}")
    if not spec.dataset.follow_symlinks:
        for path, _ in found:
            check_inside(root, (path,), key)
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        for index, _ in enumerate(pool.map(read_image_size, (path for path, _ in found)), start=1):
            if index % 2000 == 0:
                log.info("%s: checked %d/%d images", key, index, len(found))
    counts: dict[str, int] = {}
    for _, label in found:
        counts[label] = counts.get(label, 0) + 1
    log.info("%s: %d images in %d classes (%s)", key, len(found), len(counts),
             ", ".join(f"{name}={count}" for name, count in counts.items()))
    return [Crop(str(path), (0.0, 0.0, 1.0, 1.0), label) for path, label in found]


def class_list(spec: ExperimentSpec, sources: list[Source]) -> list[str]:
    """The classes the crops have, each once (names compared ignoring case, the first spelling kept):
    dataset.classes' first in their order, the others alphabetically, background last."""
    names: dict[str, str] = {}
    for source in sources:
        for crop in source.crops:
            names.setdefault(crop.label.lower(), crop.label)
    names.pop(BACKGROUND, None)
    known = [name for name in spec.dataset.classes if name.lower() in names]
    others = sorted((name for key, name in names.items() if key not in {k.lower() for k in known}), key=str.lower)
    with_background = any(crop.label.lower() == BACKGROUND for source in sources for crop in source.crops)
    return [*known, *others, *([BACKGROUND] if with_background else [])]


def split_by_image(crops: list[Crop], val_fraction: float, seed: int) -> tuple[list[Crop], list[Crop]]:
    """(train, val): the crops of a seeded `val_fraction` of the images (at least one) are val, so no image gives
    crops to both."""
    images = sorted({crop.image for crop in crops})
    if len(images) < 2:
        raise QatpipeError(f"pretraining needs crops of at least 2 images (one held back for the top-1 figure); "
                           f"the data has {len(images)}")
    count = min(len(images) - 1, max(1, int(round(val_fraction * len(images)))))
    held = {images[i] for i in np.random.default_rng(seed).choice(len(images), size=count, replace=False)}
    train = [crop for crop in crops if crop.image not in held]
    val = [crop for crop in crops if crop.image in held]
    return train, val


# --------------------------------------------------------------------------------------------------- model


def build_classifier(spec: ExperimentSpec, num_classes: int, crop_size: int | None = None):
    """The spec's backbone as a classifier: the same backbone call as the detector's build_model (the same layer
    names and weight shapes), then global average pooling and a linear layer of `num_classes` logits."""
    import tf_keras as keras

    from qatpipe.models.backbones import backbone_module
    from qatpipe.models.base import INPUT_NAME
    from qatpipe.models.blocks import weight_regularizer

    backbone = spec.model.backbone
    module = backbone_module(backbone.name)
    size = crop_size or spec.pretrain.crop_size
    inputs = keras.Input((size, size, 3), name=INPUT_NAME)
    features = module.build(inputs, backbone, weight_regularizer(spec))
    pooled = keras.layers.GlobalAveragePooling2D(name=POOL_LAYER)(features)
    # float32 logits keep the loss stable under mixed precision
    logits = keras.layers.Dense(num_classes, name=LOGITS_LAYER, dtype="float32")(pooled)
    return keras.Model(inputs, logits, name=f"pretrain_{module.label(backbone)}")


def backbone_layer_names(model) -> list[str]:
    """The layers of a pretraining classifier that the detector has too (all but the input and the head)."""
    return [layer.name for layer in model.layers
            if layer.name not in HEAD_LAYERS and layer.__class__.__name__ != "InputLayer"]


# ------------------------------------------------------------------------------------------------ tf.data


def crop_dataset(crops: list[Crop], class_ids: dict[str, int], crop_size: int, batch_size: int, seed: int,
                 training: bool):
    """Batches of (crop float32 [0, 1], class id). Training: a seeded shuffle each epoch, a random horizontal flip
    and a small colour jitter per crop; crops are decoded once and kept in memory when they fit in CACHE_BYTES."""
    import tensorflow as tf

    from qatpipe.data.pipeline import PARALLEL_CALLS, decode_image_file, prefetched

    n = len(crops)
    paths = tf.constant([crop.image for crop in crops])
    boxes = tf.constant(np.array([crop.box for crop in crops], np.float32).reshape(-1, 4))
    labels = tf.constant(np.array([class_ids[crop.label.lower()] for crop in crops], np.int32))
    cached = n * crop_size * crop_size * 3 <= CACHE_BYTES

    def load(index):
        image = decode_image_file(paths[index])
        crop = tf.image.crop_and_resize(image[None], boxes[index][None], [0], (crop_size, crop_size))[0]
        return tf.cast(tf.round(tf.clip_by_value(crop, 0.0, 1.0) * 255.0), tf.uint8), labels[index]

    def augment(crop, label, pair):
        seeds = tf.random.experimental.stateless_split(pair, num=5)
        image = tf.image.convert_image_dtype(crop, tf.float32)
        image = tf.image.stateless_random_flip_left_right(image, seeds[0])
        jitter = COLOUR_JITTER
        image = tf.image.stateless_random_brightness(image, jitter["brightness"], seeds[1])
        image = tf.image.stateless_random_contrast(image, 1 - jitter["contrast"], 1 + jitter["contrast"], seeds[2])
        image = tf.image.stateless_random_saturation(image, 1 - jitter["saturation"], 1 + jitter["saturation"],
                                                     seeds[3])
        image = tf.image.stateless_random_hue(image, jitter["hue"], seeds[4])
        return tf.clip_by_value(image, 0.0, 1.0), label

    ds = tf.data.Dataset.range(n)
    if cached:
        ds = ds.map(load, num_parallel_calls=PARALLEL_CALLS, deterministic=True).cache()
        if training:
            ds = ds.shuffle(n, seed=seed, reshuffle_each_iteration=True)
    else:
        if training:
            ds = ds.shuffle(n, seed=seed, reshuffle_each_iteration=True)
        ds = ds.map(load, num_parallel_calls=PARALLEL_CALLS, deterministic=True)
    if training:
        pairs = tf.data.Dataset.random(seed=seed, rerandomize_each_iteration=True).batch(2)
        ds = tf.data.Dataset.zip((ds, pairs)).map(lambda example, pair: augment(*example, pair),
                                                  num_parallel_calls=PARALLEL_CALLS, deterministic=True)
    else:
        ds = ds.map(lambda crop, label: (tf.image.convert_image_dtype(crop, tf.float32), label))
    return prefetched(ds.batch(batch_size))


# --------------------------------------------------------------------------------------------------- stage


def pretrain(spec: ExperimentSpec, results_dir: str | Path, use_amp: bool | None = None) -> dict:
    """Pretrain the spec's backbone as a classifier into `results_dir`: weights.keras (the classifier, whose
    backbone layers model.pretrained loads), classes.json, pretrain_summary.json, pretrain_log.csv, spec.yaml and
    the stage's tracking record. Returns the summary."""
    import tf_keras as keras

    from qatpipe.fileio import save_keras_model
    from qatpipe.models.backbones import backbone_module
    from qatpipe.tracking.live import live_curves
    from qatpipe.training.callbacks import EpochLog, ProgressLogger
    from qatpipe.training.precision import FLOAT32, cast_model, configure_precision
    from qatpipe.training.schedules import SoftStartAnnealingSchedule

    settings = spec.pretrain
    results_dir = Path(results_dir)
    try:
        results_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise QatpipeError(f"{results_dir}: cannot create the results directory: {exc}") from None
    started = time.perf_counter()
    sources = [read_source(spec, key, uri) for key, uri in data_entries(spec)]
    classes = class_list(spec, sources)
    if len(classes) < 2:
        raise QatpipeError(f"pretraining needs at least 2 classes; the data has {classes or 'none'} (KITTI data "
                           "gets `background` with pretrain.background_crops > 0)")
    class_ids = {name.lower(): index for index, name in enumerate(classes)}
    crops = [crop for source in sources for crop in source.crops]
    # one seeded order: the in-memory cache then holds the crops already mixed
    crops = [crops[i] for i in np.random.default_rng(settings.seed).permutation(len(crops))]
    train_crops, val_crops = split_by_image(crops, settings.val_fraction, settings.seed)
    counts = {name: 0 for name in classes}
    for crop in crops:
        counts[classes[class_ids[crop.label.lower()]]] += 1
    write_json(results_dir / CLASSES_FILE, {"classes": classes, "crops": counts})
    log.info("pretraining on %d crops of %d images in %d classes (%s); %d held back for top-1", len(crops),
             sum(source.images for source in sources), len(classes),
             ", ".join(f"{name}={count}" for name, count in counts.items()), len(val_crops))

    precision = configure_precision(settings.use_amp if use_amp is None else use_amp)
    keras.utils.set_random_seed(settings.seed)
    model = build_classifier(spec, len(classes))
    steps = math.ceil(len(train_crops) / settings.batch_size)
    schedule = SoftStartAnnealingSchedule(steps * settings.epochs, settings.learning_rate * LR_START,
                                          settings.learning_rate, SOFT_START, ANNEALING_POINT)
    model.compile(optimizer=keras.optimizers.Adam(schedule),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=[keras.metrics.SparseCategoricalAccuracy(name="top1")])
    train_ds = crop_dataset(train_crops, class_ids, settings.crop_size, settings.batch_size, settings.seed, True)
    val_ds = crop_dataset(val_crops, class_ids, settings.crop_size, settings.batch_size, settings.seed, False)

    dump_spec(spec, results_dir / SPEC_FILE)
    (results_dir / LOG_FILE).unlink(missing_ok=True)  # a run before this one's epochs must not mix in
    progress = ProgressLogger(steps, settings.epochs, settings.batch_size, max(1, steps // 4))
    callbacks = [progress, EpochLog(results_dir / LOG_FILE),
                 *([curves] if (curves := live_curves(STAGE, steps, settings.batch_size)) else [])]
    log.info("training %s (%d params) on %d crops of %dx%d: %d epochs, %d steps/epoch, batch %d, %s", model.name,
             model.count_params(), len(train_crops), settings.crop_size, settings.crop_size, settings.epochs, steps,
             settings.batch_size, precision.policy)
    history = model.fit(train_ds, validation_data=val_ds, epochs=settings.epochs, verbose=0, callbacks=callbacks)

    logits = model.predict(val_ds, verbose=0)
    truth = np.array([class_ids[crop.label.lower()] for crop in val_crops])
    predicted = logits.argmax(axis=-1)
    top1 = float((predicted == truth).mean())
    per_class = {name: round(float((predicted[truth == i] == i).mean()), 4)
                 for i, name in enumerate(classes) if (truth == i).any()}
    # an uncompiled float32 twin: no optimizer state or schedule, standard layers only (as train saves)
    export = (cast_model(model, FLOAT32) if precision.mixed else
              keras.Model(model.inputs, model.outputs, name=model.name))
    weights_path = save_keras_model(export, results_dir / WEIGHTS_FILE)

    backbone = spec.model.backbone
    summary = {
        "weights": str(weights_path), "backbone": backbone_module(backbone.name).label(backbone),
        "backbone_name": backbone.name, "crop_size": settings.crop_size, "classes": classes,
        "num_classes": len(classes), "top1": round(top1, 4), "chance": round(1 / len(classes), 4),
        "majority": round(float(np.bincount(truth, minlength=len(classes)).max() / len(truth)), 4),
        "per_class_top1": per_class, "epochs": settings.epochs,
        "images": sum(source.images for source in sources), "crops": len(crops),
        "background_crops": counts.get(BACKGROUND, 0), "train_crops": len(train_crops), "val_crops": len(val_crops),
        "sources": [{"data": source.data, "kind": source.kind, "images": source.images, "crops": len(source.crops)}
                    for source in sources],
        "final_losses": {key: round(float(values[-1]), 6) for key, values in history.history.items()},
        "crops_per_second": round(progress.images_per_second, 2), "params": int(model.count_params()),
        "precision": precision.policy, "wall_seconds": round(time.perf_counter() - started, 2),
    }
    write_json(results_dir / SUMMARY_FILE, summary)
    _write_tracking_record(spec, results_dir, summary)
    log.info("pretrained %s: val top-1 %.4f on %d crops (chance %.4f, majority class %.4f); weights: %s",
             summary["backbone"], top1, len(val_crops), summary["chance"], summary["majority"], shown(weights_path))
    return summary


def summary_metrics(summary: dict) -> dict[str, float]:
    """A pretraining summary's figures for MLflow and the KFP UI."""
    keys = ("top1", "chance", "majority", "epochs", "num_classes", "images", "crops", "background_crops",
            "train_crops", "val_crops", "crops_per_second", "params", "wall_seconds")
    metrics = {key: float(summary[key]) for key in keys}
    metrics.update({f"top1.{name}": float(value) for name, value in summary["per_class_top1"].items()})
    metrics.update({f"final_losses.{name}": float(value) for name, value in summary["final_losses"].items()})
    return metrics


def _write_tracking_record(spec: ExperimentSpec, results_dir: Path, summary: dict) -> None:
    from qatpipe.tracking.records import StageRecord, history_from_csv

    sections = {key: value for key, value in spec.to_dict().items() if key in STAGE_SECTIONS[STAGE]}
    StageRecord(
        stage=STAGE, params={**flatten(sections), "precision": summary["precision"]},
        metrics=summary_metrics(summary), history=history_from_csv(results_dir / LOG_FILE),
        artifacts=[WEIGHTS_FILE, CLASSES_FILE, SUMMARY_FILE, LOG_FILE, SPEC_FILE],
        tags={"qatpipe.backbone": summary["backbone"]},
    ).write(results_dir)


__all__ = ["pretrain", "build_classifier", "backbone_layer_names", "kitti_crops", "folder_crops", "read_source",
           "class_list", "split_by_image", "summary_metrics", "WEIGHTS_FILE", "CLASSES_FILE", "SUMMARY_FILE",
           "BACKGROUND"]
