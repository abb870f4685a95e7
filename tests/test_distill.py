"""Distillation during QAT (qat.distill_weight; training/distillation.py, models/distill.py): each architecture's
terms against a hand computation, 0 where the student equals the teacher, the wrapped model the model alone, and
a QAT retrain that distils, logs the term and saves the model it would save without."""

from __future__ import annotations

import csv

import numpy as np
import pytest
import tensorflow as tf
import tf_keras as keras

from qatpipe.models import get_architecture
from qatpipe.spec import bundled_spec_path, load_spec
from qatpipe.training.distillation import DISTILL_METRIC, Distillation

EPS = 1e-7
RNG = np.random.default_rng(0)


def spec_of(*overrides: str):
    """The bundled tiny spec (conftest's tiny_spec without its data set: these tests bring their own or
    need none)."""
    return load_spec(bundled_spec_path("tiny"), list(overrides))


def probabilities(shape, low=0.02, high=0.98):
    return RNG.uniform(low, high, shape).astype(np.float32)


def softmax(shape):
    logits = RNG.normal(0, 2, shape)
    exp = np.exp(logits - logits.max(-1, keepdims=True))
    return (exp / exp.sum(-1, keepdims=True)).astype(np.float32)


def terms_of(terms, teacher, student) -> dict[str, float]:
    teacher = {name: tf.constant(value) for name, value in teacher.items()}
    student = {name: tf.constant(value) for name, value in student.items()}
    return {name: float(term(teacher, student)) for name, term in terms.items()}


@pytest.mark.parametrize("normalizer", ["objects", "cells"])
def test_detectnet_terms_are_binary_kl_and_the_teacher_weighted_l1(normalizer):
    spec = spec_of("model.loss.coverage_weight=2", "model.loss.bbox_weight=3",
                     f"model.loss.coverage_normalizer={normalizer}")
    arch = get_architecture(spec)
    shape = (2, 3, 4, arch.num_classes)  # the terms take any grid
    teacher = {"output_cov": probabilities(shape), "output_bbox": RNG.normal(0, 1, (*shape[:3], 4 * shape[3]))}
    student = {"output_cov": probabilities(shape), "output_bbox": RNG.normal(0, 1, (*shape[:3], 4 * shape[3]))}
    teacher["output_bbox"], student["output_bbox"] = (teacher["output_bbox"].astype(np.float32),
                                                      student["output_bbox"].astype(np.float32))

    t, s = (x["output_cov"].astype(np.float64) for x in (teacher, student))
    kl = t * np.log(t / s) + (1 - t) * np.log((1 - t) / (1 - s))
    if normalizer == "objects":  # divided by the teacher's soft count of object cells
        cov = 2 * kl.sum() / max(t.max(-1).sum(), 1.0)
    else:
        cov = 2 * kl.mean()
    weight = np.repeat(t, 4, axis=-1)  # bbox channel 4c + k belongs to class c
    l1 = np.abs(student["output_bbox"].astype(np.float64) - teacher["output_bbox"])
    bbox = 3 * (weight * l1).sum() / max(weight.sum(), 1.0)

    got = terms_of(arch.distill_losses(), teacher, student)
    assert got["output_cov"] == pytest.approx(cov, rel=1e-5)
    assert got["output_bbox"] == pytest.approx(bbox, rel=1e-5)


def test_ssd_terms_are_categorical_kl_and_the_teacher_weighted_smooth_l1():
    spec = spec_of("model.arch=ssd", "model.loss.alpha=2")
    arch = get_architecture(spec)
    shape = (2, 30, 1 + arch.num_classes)
    teacher = {"output_cls": softmax(shape), "output_loc": RNG.normal(0, 1.5, (2, 30, 4)).astype(np.float32)}
    student = {"output_cls": softmax(shape), "output_loc": RNG.normal(0, 1.5, (2, 30, 4)).astype(np.float32)}

    t, s = (x["output_cls"].astype(np.float64) for x in (teacher, student))
    objects = 1 - t[..., 0]  # the teacher's object probability per prior
    assert objects.sum() > 1
    cls = (t * np.log(t / s)).sum() / objects.sum()
    diff = np.abs(student["output_loc"].astype(np.float64) - teacher["output_loc"])
    smooth = np.where(diff < 1, 0.5 * diff ** 2, diff - 0.5).sum(-1)  # per prior, as the task's box loss
    loc = 2 * (objects * smooth).sum() / objects.sum()

    got = terms_of(arch.distill_losses(), teacher, student)
    assert got["output_cls"] == pytest.approx(cls, rel=1e-5)
    assert got["output_loc"] == pytest.approx(loc, rel=1e-5)


def test_a_teacher_that_sees_nothing_is_not_divided_by_less_than_one():
    arch = get_architecture(spec_of("model.arch=ssd"))
    shape = (1, 4, 1 + arch.num_classes)
    teacher = {"output_cls": np.eye(shape[-1], dtype=np.float32)[np.zeros(shape[:2], int)],  # all background
               "output_loc": np.zeros((1, 4, 4), np.float32)}
    student = {"output_cls": softmax(shape), "output_loc": np.ones((1, 4, 4), np.float32)}
    got = terms_of(arch.distill_losses(), teacher, student)
    assert got["output_loc"] == 0.0  # no object anywhere: no box to learn
    kl = -np.log(np.clip(student["output_cls"][..., 0], EPS, 1)).sum()  # KL from a one-hot: -log s_background
    assert got["output_cls"] == pytest.approx(kl, rel=1e-5)


@pytest.mark.parametrize("arch_name", ["detectnet_v2", "ssd"])
def test_the_loss_is_exactly_zero_when_the_student_is_the_teacher(arch_name):
    arch = get_architecture(spec_of(f"model.arch={arch_name}"))
    teacher = arch.build_model()
    distillation = Distillation(teacher, arch.distill_losses(), 1.0, arch.output_names)
    images = RNG.uniform(0, 1, (2, *arch.input_hw, 3)).astype(np.float32)
    outputs = teacher(images, training=False)
    terms = terms_of(arch.distill_losses(), *[dict(zip(arch.output_names, map(np.asarray, outputs)))] * 2)
    assert terms == {name: 0.0 for name in arch.output_names}
    assert float(distillation.loss(images, outputs)) == 0.0
    student = keras.models.clone_model(teacher)
    student.set_weights(teacher.get_weights())
    assert float(distillation.loss(images, student(images, training=False))) == 0.0
    student.set_weights([w + 0.01 for w in teacher.get_weights()])
    assert float(distillation.loss(images, student(images, training=False))) > 0


def test_the_wrapped_model_is_the_student_alone(tmp_path):
    from qatpipe.training.precision import FLOAT32, cast_model

    arch = get_architecture(spec_of())
    teacher, student = arch.build_model(), arch.build_model()
    wrapped = Distillation(teacher, arch.distill_losses(), 0.5, arch.output_names).wrap(student)
    assert not teacher.trainable
    assert [v.name for v in wrapped.variables] == [v.name for v in student.variables]
    assert not {id(v) for v in wrapped.variables} & {id(v) for v in teacher.variables}
    assert [layer.name for layer in wrapped.layers] == [layer.name for layer in student.layers]
    plain = keras.Model(student.inputs, student.outputs, name=student.name)
    for model in (wrapped, plain):
        model.compile(optimizer=keras.optimizers.Adam(1e-3), loss=arch.losses())
    # the checkpoint holds what a plain model's does: no teacher
    keys = [sorted(name for name, _ in tf.train.list_variables(
        tf.train.Checkpoint(model=model).write(str(tmp_path / name / "ckpt"))))
        for model, name in ((wrapped, "wrapped"), (plain, "plain"))]
    assert keys[0] == keys[1]
    twin = cast_model(wrapped, FLOAT32)  # what train saves after mixed precision
    assert type(twin) is not type(wrapped) and [layer.name for layer in twin.layers] == \
        [layer.name for layer in student.layers]


def test_weight_and_terms_are_checked():
    arch = get_architecture(spec_of())
    teacher = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    with pytest.raises(ValueError, match="positive"):
        Distillation(teacher, arch.distill_losses(), 0.0, arch.output_names)
    with pytest.raises(ValueError, match="output_bbox"):
        Distillation(teacher, {"output_cov": arch.distill_losses()["output_cov"]}, 1.0, arch.output_names)


def structure(path):
    model = keras.models.load_model(path, compile=False)
    return ([(layer.name, type(layer).__name__) for layer in model.layers], model.output_names,
            [w.shape for w in model.weights])


@pytest.mark.slow
def test_qat_retrain_distils_logs_the_term_and_saves_the_model_it_would_without(tmp_path):
    from qatpipe.data.synth import write_synthetic_dataset
    from qatpipe.fileio import save_keras_model
    from qatpipe.models.io import load_keras_model
    from qatpipe.quantization.transform import quantize_model
    from qatpipe.stages.retrain import retrain

    # a few small images: a retrain in seconds
    write_synthetic_dataset(tmp_path / "data", num_train=16, num_val=4, seed=5, image_height=96, image_width=160)
    spec = spec_of(f"dataset.train={tmp_path / 'data' / 'train'}", f"dataset.val={tmp_path / 'data' / 'val'}",
                   "dataset.image_size.height=96", "dataset.image_size.width=160", "qat.enabled=true",
                   "retrain.epochs=1", "qat.calibration_batches=1", "qat.distill_weight=0.5",
                   "train.validation_interval=0")
    arch = get_architecture(spec)
    source = save_keras_model(arch.build_model(), tmp_path / "fp32" / "model.keras")  # the FP32 model QAT starts at
    summary = retrain(spec, source, tmp_path / "distilled")

    with open(tmp_path / "distilled" / "training_log.csv") as handle:
        rows = list(csv.DictReader(handle))
    assert len(rows) == 1 and float(rows[0][DISTILL_METRIC]) > 0
    # `loss` is the task loss (and the tiny spec's small L1 regularisation), without the weighted distillation
    row = {key: float(value) for key, value in rows[0].items()}
    assert row["loss"] == pytest.approx(row["output_cov_loss"] + row["output_bbox_loss"], rel=1e-2)
    assert summary["final_losses"][DISTILL_METRIC] == pytest.approx(float(rows[0][DISTILL_METRIC]))
    assert "distill_weight" in (tmp_path / "distilled" / "spec.yaml").read_text()

    # the model a retrain without distillation trains and saves: the QAT twin of the source (no teacher layers,
    # the same outputs; the ONNX export reads model.keras alone)
    twin = save_keras_model(quantize_model(load_keras_model(source, arch), spec.qat), tmp_path / "twin.keras")
    assert structure(summary["model"]) == structure(twin)
