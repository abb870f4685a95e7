"""tf.data input pipelines: decode, resize, augment, encode targets, batch, prefetch.

Training data is a pure function of (seed, epoch, sample index): the epoch order comes from a stateless
shuffle and every random augmentation from a stateless seed. A job resumed at epoch k therefore sees
exactly the batches the interrupted job would have seen.
"""

from __future__ import annotations

import os

import numpy as np
import tensorflow as tf

from qatpipe.data.kitti import KittiSample
from qatpipe.errors import DataError, QatpipeError
from qatpipe.models.base import DetectorArchitecture
from qatpipe.spec import AugmentationSpec, ExperimentSpec

_GREY = 0.5  # fill for the area a zoom-out or shift reveals
PARALLEL_CALLS = max(2, min(8, os.cpu_count() or 2))
_PREFETCH_BATCHES = 2


def prefetched(ds: tf.data.Dataset) -> tf.data.Dataset:
    """Prefetch, with tf.data autotuning off.

    Autotuning buys nothing here (decoding runs ~10x faster than a training step), and with it on, TF 2.21
    intermittently blocks for seconds (up to ~40 s after a 14-epoch run) when Keras releases the iterator,
    waiting for the autotuner's thread. Fixed parallelism gives the same throughput without the stall.
    """
    options = tf.data.Options()
    options.autotune.enabled = False
    options.deterministic = True
    return ds.prefetch(_PREFETCH_BATCHES).with_options(options)


def pack_samples(samples: list[KittiSample], max_boxes: int) -> dict[str, np.ndarray]:
    """Ragged labels -> fixed-size arrays that tf.data can slice (class id -1 marks padding)."""
    n = len(samples)
    boxes = np.zeros((n, max_boxes, 4), np.float32)
    classes = np.full((n, max_boxes), -1, np.int32)
    for i, sample in enumerate(samples):
        if len(sample.classes) > max_boxes:
            raise DataError(
                sample.label_path, f"{len(sample.classes)} objects > dataset.max_boxes_per_image={max_boxes}"
            )
        boxes[i, : len(sample.classes)] = sample.boxes
        classes[i, : len(sample.classes)] = sample.classes
    return {
        "path": np.array([str(s.image_path) for s in samples]),
        "boxes": boxes,
        "classes": classes,
    }


def decode_image_file(path):
    """An image file as float32 [0, 1], HxWx3: how training, evaluation and the MLflow model read images."""
    image = tf.io.decode_image(tf.io.read_file(path), channels=3, expand_animations=False)
    return tf.image.convert_image_dtype(image, tf.float32)  # [0, 1]


def _zoom_shift(image, boxes, classes, aug: AugmentationSpec, height, width, seed):
    """Random scale/translate jitter and resize in one resampling step; boxes follow, cut boxes dropped."""
    src_h = tf.cast(tf.shape(image)[0], tf.float32)
    src_w = tf.cast(tf.shape(image)[1], tf.float32)
    u = tf.random.stateless_uniform((3,), seed=seed)
    scale = aug.scale_min + (aug.scale_max - aug.scale_min) * u[0]
    # window of the source image (normalised coordinates) that becomes the output
    win_h, win_w = 1.0 / scale, 1.0 / scale
    cy = 0.5 + aug.translate * (2 * u[1] - 1)
    cx = 0.5 + aug.translate * (2 * u[2] - 1)
    y0, x0 = cy - win_h / 2, cx - win_w / 2
    # crop_and_resize samples output row i at y1*(H-1) + i*(y2-y1)*(H-1)/(h-1) (pixel-index space); put the
    # first and last samples at the centres of the first and last output pixels, as tf.image.resize does,
    # so boxes (pixel-edge coordinates) stay aligned and training sees what evaluation sees.
    first_y = y0 * src_h + 0.5 * win_h * src_h / height - 0.5
    last_y = y0 * src_h + (height - 0.5) * win_h * src_h / height - 0.5
    first_x = x0 * src_w + 0.5 * win_w * src_w / width - 0.5
    last_x = x0 * src_w + (width - 0.5) * win_w * src_w / width - 0.5
    window = tf.stack([first_y / (src_h - 1), first_x / (src_w - 1), last_y / (src_h - 1), last_x / (src_w - 1)])
    out = tf.image.crop_and_resize(image[None], window[None], [0], (height, width), extrapolation_value=_GREY)[0]

    # source pixels -> output pixels
    sx, sy = width / (win_w * src_w), height / (win_h * src_h)
    offset = tf.stack([x0 * src_w, y0 * src_h, x0 * src_w, y0 * src_h])
    moved = (boxes - offset) * tf.stack([sx, sy, sx, sy])
    clipped = tf.clip_by_value(moved, 0.0, tf.constant([width, height, width, height], tf.float32))
    area = lambda b: tf.maximum(b[:, 2] - b[:, 0], 0) * tf.maximum(b[:, 3] - b[:, 1], 0)  # noqa: E731
    visible = area(clipped) / tf.maximum(area(moved), 1e-6)
    keep = (classes >= 0) & (visible >= aug.min_visible_fraction) & (area(clipped) > 1.0)
    return out, tf.where(keep[:, None], clipped, 0.0), tf.where(keep, classes, -1)


def _hflip(image, boxes, classes, prob, width, seed):
    flip = tf.random.stateless_uniform((), seed=seed) < prob
    flipped = tf.stack([width - boxes[:, 2], boxes[:, 1], width - boxes[:, 0], boxes[:, 3]], axis=1)
    flipped = tf.where((classes >= 0)[:, None], flipped, 0.0)
    return (
        tf.cond(flip, lambda: image[:, ::-1, :], lambda: image),
        tf.cond(flip, lambda: flipped, lambda: boxes),
    )


def _colour(image, aug: AugmentationSpec, seeds):
    if aug.brightness:
        image = tf.image.stateless_random_brightness(image, aug.brightness, seeds[0])
    if aug.contrast:
        image = tf.image.stateless_random_contrast(image, 1 - aug.contrast, 1 + aug.contrast, seeds[1])
    if aug.saturation:
        image = tf.image.stateless_random_saturation(image, 1 - aug.saturation, 1 + aug.saturation, seeds[2])
    if aug.hue:
        image = tf.image.stateless_random_hue(image, aug.hue, seeds[3])
    return tf.clip_by_value(image, 0.0, 1.0)


def _augment(image, boxes, classes, aug: AugmentationSpec, height, width, seed):
    seeds = tf.random.experimental.stateless_split(seed, num=6)
    image, boxes, classes = _zoom_shift(image, boxes, classes, aug, height, width, seeds[0])
    image, boxes = _hflip(image, boxes, classes, aug.hflip_prob, float(width), seeds[1])
    return _colour(image, aug, seeds[2:]), boxes, classes


def steps_per_epoch(num_samples: int, batch_size: int, world_size: int = 1) -> int:
    """Full batches per epoch and worker (the last partial batch is dropped)."""
    steps = (num_samples // world_size) // batch_size
    if steps == 0:
        raise QatpipeError(
            f"dataset.train has {num_samples} images: fewer than one batch of {batch_size} per worker "
            f"({world_size} workers)"
        )
    return steps


def train_dataset(
    samples: list[KittiSample], spec: ExperimentSpec, arch: DetectorArchitecture, initial_epoch: int = 0,
    shard: tuple[int, int] = (0, 1),
) -> tuple[tf.data.Dataset, int]:
    """Batches (image, targets) for epochs initial_epoch..epochs-1, and the number of steps per epoch.

    `shard=(rank, world_size)` gives each data-parallel worker its own slice of every epoch.
    """
    train, size, aug = spec.train, spec.dataset.image_size, spec.augmentation
    packed = pack_samples(samples, spec.dataset.max_boxes_per_image)
    n = len(samples)
    rank, world = shard
    steps = steps_per_epoch(n, train.batch_size, world)
    table = {k: tf.constant(v) for k, v in packed.items()}
    seed = train.seed

    def epoch_indices(epoch):
        order = tf.random.experimental.stateless_shuffle(tf.range(n, dtype=tf.int64), seed=[seed, epoch])
        order = order[rank::world][: steps * train.batch_size]
        return tf.data.Dataset.from_tensor_slices(order).map(lambda i: (epoch, i))

    def load(epoch, index):
        image = decode_image_file(table["path"][index])
        boxes, classes = table["boxes"][index], table["classes"][index]
        sample_seed = tf.stack([tf.cast(seed, tf.int64) + 1, epoch * n + index])
        image, boxes, classes = _augment(image, boxes, classes, aug, size.height, size.width, sample_seed)
        return image, arch.encode(boxes, classes)

    ds = tf.data.Dataset.range(initial_epoch, train.epochs).flat_map(epoch_indices)
    ds = ds.map(load, num_parallel_calls=PARALLEL_CALLS, deterministic=True)
    return prefetched(ds.batch(train.batch_size, drop_remainder=True)), steps


def eval_dataset(samples: list[KittiSample], spec: ExperimentSpec, batch_size: int | None = None) -> tf.data.Dataset:
    """Batches of resized images, in sample order, no augmentation."""
    size = spec.dataset.image_size
    paths = tf.constant([str(s.image_path) for s in samples])

    def load(path):
        image = decode_image_file(path)
        return tf.image.resize(image, (size.height, size.width))

    ds = tf.data.Dataset.from_tensor_slices(paths).map(load, num_parallel_calls=PARALLEL_CALLS)
    return prefetched(ds.batch(batch_size or spec.evaluate.batch_size))


def eval_targets(samples: list[KittiSample], spec: ExperimentSpec, arch: DetectorArchitecture,
                 batch_size: int | None = None) -> tf.data.Dataset:
    """The training targets of `samples` at the network input size, without augmentation, batched as
    `eval_dataset` batches their images: what the losses compare a model's outputs on those images with.
    Every object counts: an image with more than `dataset.max_boxes_per_image` (a training-batch limit) widens
    the padding here, as `evaluate` scores all of its objects."""
    size = spec.dataset.image_size
    packed = pack_samples(samples, max(spec.dataset.max_boxes_per_image,
                                       max((len(s.classes) for s in samples), default=0)))
    scale = np.array([[size.width / s.width, size.height / s.height] * 2 for s in samples], np.float32)
    limits = np.array([size.width, size.height] * 2, np.float32)
    boxes = np.clip(packed["boxes"] * scale[:, None, :], 0, limits)  # as training clips them (padding stays 0)
    ds = tf.data.Dataset.from_tensor_slices((boxes, packed["classes"])).map(
        arch.encode, num_parallel_calls=PARALLEL_CALLS)
    return prefetched(ds.batch(batch_size or spec.evaluate.batch_size))
