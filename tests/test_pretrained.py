"""Pretrained weights (issue 36): model.pretrained loads by layer name and reports what it did, keras:imagenet's
name map and conversions, model.freeze_blocks / model.freeze_bn through train and a QAT retrain, and every bad
source failing before training with the file (or the key) and the reason."""

from __future__ import annotations

import json
import re
import socket

import numpy as np
import pytest
import tf_keras as keras

from qatpipe.errors import ModelFileError, SpecError, StorageError
from qatpipe.models import get_architecture
from qatpipe.models.backbones import backbone_module
from qatpipe.models.pretrained import (applications_weights, freeze, load_applications_file, load_pretrained,
                                       read_weights)
from qatpipe.spec import bundled_spec_path, load_spec

L = keras.layers


def small_spec(*overrides: str):
    """The tiny spec at a 64x96 input."""
    return load_spec(bundled_spec_path("tiny"), ["dataset.image_size.height=64", "dataset.image_size.width=96",
                                                 *overrides])


def build(spec, seed: int):
    keras.utils.set_random_seed(seed)
    model = get_architecture(spec).build_model()
    rng = np.random.default_rng(seed)
    for layer in model.layers:  # non-trivial batch norms, so their four weights matter
        if isinstance(layer, L.BatchNormalization):
            n = layer.gamma.shape[0]
            layer.set_weights([rng.uniform(0.5, 1.5, n), rng.normal(0, 0.3, n), rng.normal(0, 0.2, n),
                               rng.uniform(0.5, 2.0, n)])
    return model


def weighted(model) -> list[str]:
    return [layer.name for layer in model.layers if layer.weights]


IMAGE = np.random.default_rng(0).uniform(0, 1, (2, 64, 96, 3)).astype(np.float32)


# --------------------------------------------------------------------------------------- loading by name


@pytest.mark.parametrize("saved", ["model.keras", "model.h5", "weights.h5"])
def test_a_saved_model_loads_into_a_fresh_one_with_identical_outputs(saved, tmp_path):
    spec = small_spec()
    source = build(spec, seed=1)
    path = tmp_path / saved
    source.save_weights(path) if saved.startswith("weights") else source.save(path)
    target = build(spec, seed=2)
    assert not np.allclose(target(IMAGE)[0], source(IMAGE)[0])

    report = load_pretrained(target, str(path), spec.model.backbone)
    assert report.loaded == weighted(target)
    assert report.skipped == report.random == report.unused == []
    for got, want in zip(target(IMAGE), source(IMAGE)):
        np.testing.assert_array_equal(got.numpy(), want.numpy())


def test_a_layer_of_other_shapes_is_skipped_and_reported(tmp_path):
    source = build(small_spec("dataset.classes=[car, van]"), seed=1)  # 2 classes: other head shapes
    source.save(tmp_path / "two_classes.keras")
    spec = small_spec()
    target = build(spec, seed=2)
    heads = {name: target.get_layer(name).get_weights() for name in ("conv_cov", "conv_bbox")}

    report = load_pretrained(target, str(tmp_path / "two_classes.keras"), spec.model.backbone)
    assert [s["layer"] for s in report.skipped] == ["conv_cov", "conv_bbox"]
    assert report.skipped[0] == {"layer": "conv_cov", "model_shapes": [[1, 1, 128, 3], [3]],
                                 "file_shapes": [[1, 1, 128, 2], [2]]}
    assert report.loaded == [name for name in weighted(target) if name not in heads]
    assert report.random == report.unused == []
    for name, before in heads.items():  # skipped: left as they were
        for got, want in zip(target.get_layer(name).get_weights(), before):
            np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(target.get_layer("block_3a_conv_1").get_weights()[0],
                                  source.get_layer("block_3a_conv_1").get_weights()[0])
    assert "2 skipped for other shapes (conv_cov, conv_bbox)" in report.summary()
    assert json.loads(json.dumps(report.to_dict()))["summary"] == report.summary()


def test_a_backbone_classifier_loads_and_its_other_layers_are_reported(tmp_path):
    """What qatpipe pretrain writes: the backbone under a classifier head, at another input size."""
    spec = small_spec()
    inputs = keras.Input((32, 32, 3))
    features = backbone_module("resnet").build(inputs, spec.model.backbone, None)
    outputs = L.Dense(4, name="predictions")(L.GlobalAveragePooling2D(name="pool")(features))
    keras.Model(inputs, outputs).save(tmp_path / "classifier.keras")

    target = build(spec, seed=2)
    report = load_pretrained(target, str(tmp_path / "classifier.keras"), spec.model.backbone)
    assert report.unused == ["predictions"]
    assert report.random == ["conv_cov", "conv_bbox"] and report.random_backbone == []
    assert report.loaded == weighted(target)[:-2]


# ------------------------------------------------------------------------------------- keras:imagenet


def _applications_model(backbone: str):
    """tf_keras.applications' model of `backbone`, weights=None (no network), with non-trivial batch norms and
    (EfficientNet) ImageNet's input normalisation, so the conversions are exercised."""
    if backbone == "mobilenet_v2":
        model = keras.applications.MobileNetV2(weights=None, include_top=False, input_shape=(64, 96, 3), alpha=1.0)
    else:
        model = keras.applications.EfficientNetB0(weights=None, include_top=False, input_shape=(64, 96, 3))
    rng = np.random.default_rng(3)
    for layer in model.layers:
        if isinstance(layer, L.BatchNormalization):  # small variances: where the epsilon matters
            n = layer.gamma.shape[0]
            layer.set_weights([rng.uniform(0.5, 1.5, n), rng.normal(0, 0.3, n), rng.normal(0, 0.2, n),
                               rng.uniform(1e-3, 1e-2, n)])
        if isinstance(layer, L.Normalization):
            layer.set_weights([np.array([0.485, 0.456, 0.406]), np.array([0.229, 0.224, 0.225]) ** 2,
                               np.array(0)])
    return model


@pytest.mark.parametrize("backbone, suffix, extra, renamed", [
    ("mobilenet_v2", ".h5", ["Conv_1", "Conv_1_bn"], ("expanded_conv_project", "block_0_project")),
    ("efficientnet_b0", ".keras", ["normalization", "top_conv", "top_bn"], ("block3b_dwconv", "block3b_dwconv")),
])
def test_keras_applications_weights_fill_every_backbone_layer(backbone, suffix, extra, renamed, tmp_path):
    spec = small_spec(f"model.backbone.name={backbone}", "model.backbone.width=1.0")
    application = _applications_model(backbone)
    application.save(tmp_path / f"application{suffix}")
    target = build(spec, seed=2)

    report = load_applications_file(target, tmp_path / f"application{suffix}", spec.model.backbone)
    assert report.random_backbone == [] and report.skipped == []
    assert report.random == ["conv_cov", "conv_bbox"]
    # Keras numbers the normalization layers of a session: normalization_1, ...
    assert [re.sub(r"^normalization_\d+$", "normalization", name) for name in report.unused] == extra
    keras_name, name = renamed
    np.testing.assert_array_equal(target.get_layer(name).get_weights()[0],
                                  application.get_layer(keras_name).get_weights()[0])

    # the stem computes what the applications model computes on its own input scaling (but at the border)
    stem_bn = backbone_module(backbone).KERAS_APPLICATION.stem[1]
    preprocess = backbone_module(backbone).KERAS_APPLICATION.preprocess
    want = keras.Model(application.inputs, application.get_layer(stem_bn).output)(preprocess(IMAGE)).numpy()
    got = keras.Model(target.inputs, target.get_layer(stem_bn).output)(IMAGE).numpy()
    np.testing.assert_allclose(got[:, 1:-1, 1:-1], want[:, 1:-1, 1:-1], atol=1e-4 * np.abs(want).max())


def test_keras_imagenet_checks_the_backbone_and_width():
    with pytest.raises(SpecError, match="model.pretrained: keras:imagenet has no weights for the resnet backbone"
                                        ".*load as files"):
        load_pretrained(None, "keras:imagenet", small_spec().model.backbone)
    spec = small_spec("model.backbone.name=mobilenet_v2", "model.backbone.width=0.25")
    with pytest.raises(SpecError, match=r"widths \(alpha\) 0.35, 0.5, 0.75, 1, 1.3, 1.4; model.backbone.width is "
                                        "0.25"):
        load_pretrained(None, "keras:imagenet", spec.model.backbone)
    with pytest.raises(SpecError, match="keras:imagenet has efficientnet_b0 weights for widths"):
        applications_weights(None, small_spec("model.backbone.name=efficientnet_b0").model.backbone)
    with pytest.raises(SpecError, match="keras:coco is not a source"):
        load_pretrained(None, "keras:coco", small_spec().model.backbone)
    with pytest.raises(SpecError, match="pipeline:pretrain names a pipeline run's own pretrain stage"):
        load_pretrained(None, "pipeline:pretrain", small_spec().model.backbone)


# ------------------------------------------------------------------------------------------- bad input


def test_missing_corrupt_and_foreign_files_are_named_with_the_reason(tmp_path):
    spec = small_spec("model.backbone.name=mobilenet_v2")
    target = build(spec, seed=2)
    with pytest.raises(ModelFileError, match=f"model.pretrained: {tmp_path / 'none.keras'}: pretrained weights "
                                             "file not found"):
        load_pretrained(target, str(tmp_path / "none.keras"), spec.model.backbone)
    for name in ("x.keras", "x.h5"):
        (tmp_path / name).write_bytes(b"not a model" * 100)
        with pytest.raises(ModelFileError, match=f"{tmp_path / name}: corrupt weights file"):
            load_pretrained(target, str(tmp_path / name), spec.model.backbone)
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(ModelFileError, match="notes.txt: not a Keras weights file"):
        load_pretrained(target, str(tmp_path / "notes.txt"), spec.model.backbone)
    with pytest.raises(ModelFileError, match="cannot read its weights"):  # a zip, but no Keras model in it
        import zipfile
        with zipfile.ZipFile(tmp_path / "empty.keras", "w") as archive:
            archive.writestr("readme", "x")
        read_weights(tmp_path / "empty.keras")

    resnet = build(small_spec(), seed=1)
    resnet.save(tmp_path / "resnet.keras")
    with pytest.raises(ModelFileError, match=rf"nothing in {tmp_path / 'resnet.keras'} matches the backbone's "
                                             r"layers \(the file has conv1, bn_conv1, .*; the mobilenet_v2 backbone "
                                             "has Conv1, bn_Conv1"):
        load_pretrained(target, str(tmp_path / "resnet.keras"), spec.model.backbone)
    wider = small_spec("model.backbone.width=0.5")
    with pytest.raises(ModelFileError, match=r"resnet.keras: the backbone's layers have other weight shapes there, "
                                             r"e.g. conv1: \[\[7, 7, 3, 16\]\] in the file, \[\[7, 7, 3, 32\]\]"):
        load_pretrained(build(wider, seed=2), str(tmp_path / "resnet.keras"), wider.model.backbone)


def test_an_unreachable_s3_uri_is_named(monkeypatch, tmp_path):
    with socket.socket() as sock:  # bound, not listening: connections are refused
        sock.bind(("127.0.0.1", 0))
        endpoint = f"http://127.0.0.1:{sock.getsockname()[1]}"
        monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
        with pytest.raises(StorageError) as raised:
            load_pretrained(None, "s3://weights/resnet10.keras", small_spec().model.backbone, tmp_path)
    assert str(raised.value).startswith("model.pretrained: S3 endpoint unreachable for s3://weights/resnet10.keras")
    assert endpoint in str(raised.value)


def test_an_s3_weights_file_downloads_once_into_the_cache(monkeypatch, tmp_path):
    from moto.server import ThreadedMotoServer

    from qatpipe.storage import s3_client

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        for key, value in {"AWS_ENDPOINT_URL": f"http://{host}:{port}", "AWS_ACCESS_KEY_ID": "testing",
                           "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}.items():
            monkeypatch.setenv(key, value)
        spec = small_spec()
        build(spec, seed=1).save(tmp_path / "resnet.keras")
        client = s3_client()
        client.create_bucket(Bucket="weights")
        client.upload_file(str(tmp_path / "resnet.keras"), "weights", "v1/resnet.keras")

        cache = tmp_path / "cache"
        report = load_pretrained(build(spec, seed=2), "s3://weights/v1/resnet.keras", spec.model.backbone, cache)
        assert report.source == "s3://weights/v1/resnet.keras" and report.random == []
        cached = cache / "s3" / "weights" / "v1" / "resnet.keras"
        mtime = cached.stat().st_mtime_ns
        load_pretrained(build(spec, seed=2), "s3://weights/v1/resnet.keras", spec.model.backbone, cache)
        assert cached.stat().st_mtime_ns == mtime  # unchanged object: not downloaded again
        with pytest.raises(StorageError, match="model.pretrained: no such object: s3://weights/v1/other.keras"):
            load_pretrained(None, "s3://weights/v1/other.keras", spec.model.backbone, cache)
    finally:
        server.stop()


def test_an_unknown_block_is_a_spec_error_naming_the_valid_ones():
    model = build(small_spec(), seed=1)
    with pytest.raises(SpecError, match="model.freeze_blocks: 5 not a block of the resnet backbone; its blocks "
                                        r"are 0-4 \(docs/pretrained.md\)"):
        freeze(model, small_spec().model.backbone, [1, 5], False)
    assert all(layer.trainable for layer in model.layers)


def test_block_numbers_cover_every_backbone_layer_and_no_head():
    for name in ("resnet", "mobilenet_v2", "efficientnet_b0"):
        spec = small_spec(f"model.backbone.name={name}")
        model = get_architecture(spec).build_model()
        module = backbone_module(name)
        blocks = {layer.name: module.block_of(layer.name) for layer in model.layers if layer.weights}
        assert {blocks.pop("conv_cov"), blocks.pop("conv_bbox")} == {None}
        assert set(blocks.values()) == set(module.FREEZE_BLOCKS), name  # each block has weights, none is left out
    mobilenet = backbone_module("mobilenet_v2").block_of
    assert [mobilenet(f"block_{i}_project") for i in (0, 1, 2, 3, 16)] == [1, 2, 2, 3, 7]


# ------------------------------------------------------------------------------- through train and QAT


@pytest.mark.slow
def test_training_starts_from_the_file_and_frozen_blocks_stay_frozen_through_qat(tiny_spec, tmp_path):
    from qatpipe.errors import QatpipeError
    from qatpipe.stages.retrain import retrain
    from qatpipe.stages.train import train

    base = ("train.epochs=1", "model.backbone.width=0.125", "train.validation_interval=0")
    start = build(tiny_spec(*base), seed=1)
    start.save(tmp_path / "start.keras")
    spec = tiny_spec(*base, f"model.pretrained={tmp_path / 'start.keras'}", "model.freeze_blocks=[0, 1]",
                     "model.freeze_bn=true")
    train(spec, tmp_path / "run")

    trained = keras.models.load_model(tmp_path / "run" / "model.keras", compile=False)
    report = json.loads((tmp_path / "run" / "pretrained_report.json").read_text())
    assert report["loaded"] == weighted(trained) and report["source"] == str(tmp_path / "start.keras")
    assert "pretrained_report.json" in json.loads((tmp_path / "run" / "tracking.json").read_text())["artifacts"]

    def unchanged(model, name):
        return all(np.array_equal(a, b) for a, b in zip(model.get_layer(name).get_weights(),
                                                        start.get_layer(name).get_weights()))

    assert all(unchanged(trained, name) for name in ("conv1", "block_1a_conv_1", "block_1a_conv_shortcut"))
    assert not unchanged(trained, "block_2a_conv_1") and not unchanged(trained, "conv_cov")
    # freeze_bn: every batch norm, in unfrozen blocks too, keeps its statistics, scale and offset
    assert all(unchanged(trained, layer.name) for layer in trained.layers if isinstance(layer, L.BatchNormalization))

    spec.qat.enabled, spec.retrain.epochs, spec.qat.calibration_batches = True, 1, 1
    retrain(spec, tmp_path / "run" / "model.keras", tmp_path / "qat")
    qat = keras.models.load_model(tmp_path / "qat" / "model.keras", compile=False)
    assert type(qat.get_layer("block_1a_conv_1")).__name__ == "QDQConv2D"

    def float_weights(name):  # the quantized layer's own weights come first, its ranges after
        return qat.get_layer(name).get_weights()[:len(trained.get_layer(name).get_weights())]

    for name in ("conv1", "block_1a_conv_1", "bn_conv1", "block_3a_bn_1"):
        assert all(np.array_equal(a, b) for a, b in zip(float_weights(name), trained.get_layer(name).get_weights()))
    assert not np.array_equal(float_weights("block_2a_conv_1")[0], trained.get_layer("block_2a_conv_1").get_weights()[0])

    # bad sources fail before training: nothing of a run is written
    for bad in (tmp_path / "missing.keras", "keras:imagenet"):
        with pytest.raises(QatpipeError, match="model.pretrained"):
            train(tiny_spec(*base, f"model.pretrained={bad}"), tmp_path / "bad")
        assert not (tmp_path / "bad" / "spec.yaml").exists()
