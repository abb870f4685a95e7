"""tf.data pipeline: deterministic per seed, resumable mid-training, and boxes follow the pixels."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from qatpipe.data.pipeline import _augment, eval_dataset, train_dataset
from qatpipe.data.splits import load_split
from qatpipe.models import get_architecture
from qatpipe.spec import AugmentationSpec


def first_batches(spec, initial_epoch=0, count=1):
    samples = load_split(spec, "train")
    ds, steps = train_dataset(samples, spec, get_architecture(spec), initial_epoch=initial_epoch)
    return [(x.numpy(), {k: v.numpy() for k, v in y.items()}) for x, y in ds.take(count)], steps


def test_same_seed_same_batches_other_seed_differs(tiny_spec):
    (a,), _ = first_batches(tiny_spec())
    (b,), _ = first_batches(tiny_spec())
    (c,), _ = first_batches(tiny_spec("train.seed=7"))
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1]["output_cov"], b[1]["output_cov"])
    assert not np.array_equal(a[0], c[0])


def test_resumed_stream_equals_the_uninterrupted_one(tiny_spec):
    spec = tiny_spec()
    samples = load_split(spec, "train")
    ds, steps = train_dataset(samples, spec, get_architecture(spec), initial_epoch=0)
    epoch1_first = next(iter(ds.skip(steps)))
    (resumed,), _ = first_batches(spec, initial_epoch=1)
    np.testing.assert_array_equal(epoch1_first[0].numpy(), resumed[0])
    (epoch0_first,), _ = first_batches(spec, initial_epoch=0)
    assert not np.array_equal(epoch0_first[0], resumed[0])  # a new epoch is a new order / new augmentation


def test_batches_have_the_spec_shapes(tiny_spec):
    spec = tiny_spec()
    (batch,), steps = first_batches(spec)
    images, targets = batch
    assert steps == 192 // spec.train.batch_size
    assert images.shape == (8, 192, 320, 3) and images.dtype == np.float32
    assert 0.0 <= images.min() and images.max() <= 1.0
    assert targets["output_cov"].shape == (8, 12, 20, 3)
    assert targets["output_bbox"].shape == (8, 12, 20, 15)
    assert targets["output_cov"].sum() > 0
    evaluated = next(iter(eval_dataset(load_split(spec, "val"), spec, batch_size=4)))
    assert evaluated.shape == (4, 192, 320, 3)


def _box_image(height, width, box):
    image = np.zeros((height, width, 3), np.float32)
    x1, y1, x2, y2 = box
    image[y1:y2, x1:x2] = 1.0
    return image


@pytest.mark.parametrize("seed", range(6))
def test_augmented_box_follows_the_pixels(seed):
    """A white box on black: after zoom, shift and flip the white pixels are exactly where the box says."""
    aug = AugmentationSpec(hflip_prob=0.5, scale_min=0.7, scale_max=1.4, translate=0.15, brightness=0,
                           contrast=0, saturation=0, hue=0, min_visible_fraction=0.0)
    box = (100, 60, 180, 124)
    image = tf.constant(_box_image(192, 320, box))
    boxes = tf.constant([list(map(float, box)), [0, 0, 0, 0]], tf.float32)
    classes = tf.constant([1, -1], tf.int32)
    out, out_boxes, out_classes = _augment(image, boxes, classes, aug, 96, 160, tf.constant([seed, 1], tf.int64))
    out = out.numpy()[..., 0]
    x1, y1, x2, y2 = out_boxes.numpy()[0]
    assert out_classes.numpy().tolist() == [1, -1]
    inner = out[int(np.ceil(y1)) + 1 : int(y2) - 1, int(np.ceil(x1)) + 1 : int(x2) - 1]
    assert inner.size > 0 and inner.min() > 0.9
    outside = out.copy()
    outside[max(int(y1) - 1, 0) : int(np.ceil(y2)) + 1, max(int(x1) - 1, 0) : int(np.ceil(x2)) + 1] = 0
    assert outside.max() < 0.6  # only the grey fill (0.5) or black remain outside the box


def test_box_cut_off_by_zoom_is_dropped():
    aug = AugmentationSpec(hflip_prob=0, scale_min=2.0, scale_max=2.0, translate=0, brightness=0, contrast=0,
                           saturation=0, hue=0, min_visible_fraction=0.5)
    boxes = tf.constant([[120, 72, 200, 120], [0, 0, 40, 40]], tf.float32)  # centre box, corner box
    _, out_boxes, out_classes = _augment(tf.zeros((192, 320, 3)), boxes, tf.constant([0, 2]), aug, 192, 320,
                                         tf.constant([0, 0], tf.int64))
    np.testing.assert_allclose(out_boxes.numpy()[0], [80, 48, 240, 144], atol=1e-3)
    assert out_classes.numpy().tolist() == [0, -1]


@pytest.mark.parametrize("source_hw", [(384, 640), (96, 160), (192, 320)])
def test_training_resample_matches_evaluation_resize(source_hw):
    """Without zoom or shift, the training resample samples exactly where tf.image.resize does.

    Only the outermost pixel ring may differ when upsampling: its sample lies 0.25 px outside the source, where
    crop_and_resize fills grey and resize clamps to the edge.
    """
    aug = AugmentationSpec(hflip_prob=0, scale_min=1, scale_max=1, translate=0, brightness=0, contrast=0,
                           saturation=0, hue=0)
    image = tf.random.stateless_uniform((*source_hw, 3), seed=[1, 2])
    out, _, _ = _augment(image, tf.zeros((1, 4)), tf.constant([-1]), aug, 192, 320, tf.constant([0, 0], tf.int64))
    expected = tf.image.resize(image, (192, 320)).numpy()
    np.testing.assert_allclose(out.numpy()[1:-1, 1:-1], expected[1:-1, 1:-1], atol=1e-4)
