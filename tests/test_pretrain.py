"""qatpipe pretrain: the backbone as a classifier of object crops (KITTI, with background crops) or of a
class-per-folder tree, whose backbone layers are the detector's by name (model.pretrained loads them)."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
from PIL import Image

from conftest import kitti_line, write_kitti
from qatpipe.cli import main
from qatpipe.models.backbones import BACKBONES
from qatpipe.spec import bundled_spec_path, load_spec
from qatpipe.stages.pretrain import (BACKGROUND, CLASSES_FILE, HEAD_LAYERS, SUMMARY_FILE, WEIGHTS_FILE,
                                     backbone_layer_names, box_iou, build_classifier, class_list, folder_crops,
                                     kitti_crops, read_source, split_by_image)


def _spec(*overrides: str):
    return load_spec(bundled_spec_path("tiny"), list(overrides))


def _write_tree(root, classes: dict[str, list[tuple[int, int, int]]], size=(40, 30)):
    """A class-per-folder tree: class -> one solid-colour JPEG per colour."""
    for name, colours in classes.items():
        (root / name).mkdir(parents=True, exist_ok=True)
        for index, colour in enumerate(colours):
            Image.new("RGB", size, colour).save(root / name / f"{index:03d}.jpg")
    return root


@pytest.mark.parametrize("backbone", sorted(BACKBONES))
def test_classifier_backbone_layers_are_the_detectors(backbone):
    """Every layer of the classifier but its head is a detector layer of the same name and weight shapes, and
    the detector has no other layers than those and its heads: model.pretrained matches them by name."""
    from qatpipe.models import get_architecture

    spec = _spec(f"model.backbone.name={backbone}", "model.backbone.width=0.25", "dataset.image_size.height=64",
                 "dataset.image_size.width=96")
    detector = get_architecture(spec).build_model()
    classifier = build_classifier(spec, num_classes=5, crop_size=32)
    detector_layers = {layer.name: layer for layer in detector.layers}
    names = backbone_layer_names(classifier)
    assert len(names) > 10
    for name in names:
        assert name in detector_layers, name
        assert ([tuple(w.shape) for w in classifier.get_layer(name).weights]
                == [tuple(w.shape) for w in detector_layers[name].weights]), name
    assert set(detector_layers) - set(names) - {"input_1"} == {"conv_bbox", "conv_cov", "output_cov", "output_bbox"}
    assert {layer.name for layer in classifier.layers} - set(names) == {"input_1", *HEAD_LAYERS}
    assert classifier.output_shape == (None, 5)


def test_kitti_crops_margin_min_size_dontcare_and_background(tmp_path):
    # 160x96 images: a car (40x40), a pedestrian (20x60), a car too small to crop (4x4), a DontCare region
    root = write_kitti(tmp_path / "kitti", {
        "a": "\n".join([kitti_line("car", 10, 20, 50, 60), kitti_line("pedestrian", 60, 10, 80, 70),
                        kitti_line("car", 100, 10, 104, 14), kitti_line("DontCare", 120, 50, 150, 90)]),
        "b": kitti_line("Cyclist", 90, 30, 130, 80),
    })
    spec = _spec("pretrain.crop_margin=0.1", "pretrain.min_box_size=8", "pretrain.background_crops=3")
    images, crops = kitti_crops(root, spec, "pretrain.data[0]")
    assert images == 2
    objects = [crop for crop in crops if crop.label != BACKGROUND]
    assert [crop.label for crop in objects] == ["car", "pedestrian", "cyclist"]  # the spec's spelling
    assert objects[0].box == pytest.approx((16 / 96, 6 / 160, 64 / 96, 54 / 160))  # 10% margin each side
    assert objects[1].box == pytest.approx((4 / 96, 58 / 160, 76 / 96, 82 / 160))
    assert objects[2].box == pytest.approx((25 / 96, 86 / 160, 85 / 96, 134 / 160))
    backgrounds = [crop for crop in crops if crop.label == BACKGROUND]
    assert len(backgrounds) == 6
    labelled = {"a": np.array([[10, 20, 50, 60], [60, 10, 80, 70], [100, 10, 104, 14]], float),
                "b": np.array([[90, 30, 130, 80]], float)}
    for crop in backgrounds:
        y1, x1, y2, x2 = crop.box
        box = np.array([x1 * 160, y1 * 96, x2 * 160, y2 * 96])
        assert 0 <= box[0] < box[2] <= 160 and 0 <= box[1] < box[3] <= 96
        assert box_iou(box, labelled[crop.image.rsplit("/", 1)[1][0]]).max() < 0.1


def test_synthetic_kitti_crops_count_and_classes(tmp_path):
    from qatpipe.data.kitti import read_kitti_dataset
    from qatpipe.data.splits import class_map_from_spec
    from qatpipe.data.synth import write_synthetic_dataset

    written = write_synthetic_dataset(tmp_path, num_train=30, num_val=0, seed=5, image_height=96, image_width=160)
    spec = _spec(f"dataset.train={tmp_path / 'train'}", "pretrain.min_box_size=1", "pretrain.background_crops=2")
    source = read_source(spec, "dataset.train", spec.dataset.train)
    labels = [crop.label for crop in source.crops]
    assert source.kind == "kitti" and source.images == 30
    for name in ("car", "pedestrian", "cyclist"):
        assert labels.count(name) == written["splits"]["train"]["per_class"][name]
    assert 0.8 * 60 <= labels.count(BACKGROUND) <= 60
    assert class_list(spec, [source]) == ["car", "pedestrian", "cyclist", BACKGROUND]
    samples = {str(s.image_path): s for s in read_kitti_dataset(tmp_path / "train", class_map_from_spec(spec))}
    for crop in source.crops:
        if crop.label == BACKGROUND:
            sample = samples[crop.image]
            y1, x1, y2, x2 = crop.box
            box = np.array([x1 * sample.width, y1 * sample.height, x2 * sample.width, y2 * sample.height])
            assert len(sample.boxes) == 0 or box_iou(box, sample.boxes).max() < 0.1

    # a larger min_box_size drops the small objects, and only them
    fewer = kitti_crops(tmp_path / "train", _spec("pretrain.min_box_size=20", "pretrain.background_crops=0"), "k")[1]
    sizes = [min(b[2] - b[0], b[3] - b[1]) for s in samples.values() for b in s.boxes]
    assert len(fewer) == sum(size >= 20 for size in sizes) < len(sizes)


def test_class_per_folder_tree_and_the_union_of_classes(tmp_path):
    tree = _write_tree(tmp_path / "tree", {"zebra": [(0, 0, 0)] * 3, "Car": [(9, 9, 9)] * 2})
    (tree / "zebra" / "more").mkdir()
    Image.new("RGB", (20, 20)).save(tree / "zebra" / "more" / "x.png")  # deeper folders count
    (tree / ".cache").mkdir()
    Image.new("RGB", (20, 20)).save(tree / ".cache" / "y.png")  # hidden folders do not
    (tree / "notes.txt").write_text("not an image")
    spec = _spec()
    crops = folder_crops(tree, spec, "pretrain.data[1]")
    assert sorted((crop.label, crop.image.rsplit("/", 1)[1]) for crop in crops) == [
        ("car", "000.jpg"), ("car", "001.jpg"), ("zebra", "000.jpg"), ("zebra", "001.jpg"), ("zebra", "002.jpg"),
        ("zebra", "x.png")]  # `Car` is the spec's class `car`
    assert all(crop.box == (0.0, 0.0, 1.0, 1.0) for crop in crops)

    kitti = write_kitti(tmp_path / "kitti", {"a": kitti_line("cyclist", 10, 20, 50, 60)})
    spec = _spec(f"pretrain.data=[{kitti}, {tree}]")
    sources = [read_source(spec, f"pretrain.data[{i}]", uri) for i, uri in enumerate(spec.pretrain.data)]
    assert [source.kind for source in sources] == ["kitti", "folders"]
    # the spec's classes first (in its order, those the data has), then the others alphabetically, background
    assert class_list(spec, sources) == ["car", "cyclist", "zebra", BACKGROUND]


def test_split_holds_back_whole_images():
    from qatpipe.stages.pretrain import Crop

    crops = [Crop(f"img{i // 3}.png", (0, 0, 1, 1), "car") for i in range(60)]  # 20 images, 3 crops each
    train, val = split_by_image(crops, 0.25, seed=1)
    assert len(val) == 15 and len(train) == 45
    assert not {c.image for c in train} & {c.image for c in val}
    assert split_by_image(crops, 0.25, seed=1) == (train, val)


def test_stage_beats_chance_on_a_tiny_set(tmp_path):
    """~500 crops of the synthetic shapes at 32x32, 4 epochs of a narrow ResNet-10 (about 10 s on 2 CPU cores):
    top-1 0.92 here against a chance of 0.25; the bound leaves room for other hosts' arithmetic."""
    import tf_keras as keras

    from qatpipe.data.synth import write_synthetic_dataset
    from qatpipe.stages.pretrain import pretrain
    from qatpipe.tracking.records import StageRecord

    write_synthetic_dataset(tmp_path / "data", num_train=120, num_val=0, seed=3, image_height=96, image_width=160)
    spec = _spec(f"dataset.train={tmp_path / 'data' / 'train'}", "pretrain.crop_size=32", "pretrain.epochs=4",
                 "pretrain.batch_size=32", "pretrain.val_fraction=0.25", "pretrain.learning_rate=3e-3",
                 "pretrain.min_box_size=4")
    out = tmp_path / "out"
    summary = pretrain(spec, out)
    assert summary["classes"] == ["car", "pedestrian", "cyclist", BACKGROUND]
    assert summary["chance"] == 0.25
    assert summary["top1"] >= summary["chance"] + 0.3, summary
    assert summary["top1"] >= summary["majority"] + 0.2, summary
    assert summary["train_crops"] + summary["val_crops"] == summary["crops"] > 400

    assert json.loads((out / CLASSES_FILE).read_text())["classes"] == summary["classes"]
    assert json.loads((out / SUMMARY_FILE).read_text())["top1"] == summary["top1"]
    model = keras.models.load_model(out / WEIGHTS_FILE, compile=False)  # standard layers: no custom objects
    assert model.output_shape == (None, 4) and model.input_shape == (None, 32, 32, 3)
    record = StageRecord.read(out)
    assert record.stage == "pretrain" and record.metrics["top1"] == summary["top1"]
    assert record.metrics["chance"] == 0.25 and record.metrics["crops"] == summary["crops"]
    assert [step for step, _ in record.history["val_top1"]] == [1, 2, 3, 4]
    assert record.params["pretrain.crop_size"] == 32 and "train.epochs" not in record.params
    assert WEIGHTS_FILE in record.artifacts and all((out / name).exists() for name in record.artifacts)


def test_cli_writes_the_weights(tmp_path, capsys):
    tree = _write_tree(tmp_path / "tree", {"red": [(200, 20, 20)] * 6, "blue": [(20, 20, 200)] * 6})
    out = tmp_path / "out"
    assert main(["pretrain", "--spec", "tiny", "--output", str(out), "--set", f"pretrain.data=[{tree}]",
                 "--set", "pretrain.crop_size=32", "--set", "pretrain.epochs=1", "--set", "pretrain.batch_size=8",
                 "--set", "pretrain.val_fraction=0.2"]) == 0
    assert (out / WEIGHTS_FILE).is_file()
    assert json.loads((out / CLASSES_FILE).read_text())["classes"] == ["blue", "red"]
    assert f"{out / WEIGHTS_FILE}  resnet10  val top-1" in capsys.readouterr().out


def _pretrain_error(tmp_path, caplog, data) -> str:
    with caplog.at_level(logging.ERROR):
        code = main(["pretrain", "-e", "tiny", "-r", str(tmp_path / "out"), "--set", f"pretrain.data=[{data}]"])
    assert code == 2
    assert "Traceback" not in caplog.text
    return caplog.text


def test_missing_folder_is_named(tmp_path, caplog):
    text = _pretrain_error(tmp_path, caplog, tmp_path / "nowhere")
    assert f"{tmp_path / 'nowhere'}: pretrain.data[0]: data set folder not found" in text


def test_folder_without_images_is_named(tmp_path, caplog):
    (tmp_path / "empty" / "cats").mkdir(parents=True)
    (tmp_path / "empty" / "cats" / "readme.txt").write_text("no images here")
    text = _pretrain_error(tmp_path, caplog, tmp_path / "empty")
    assert f"{tmp_path / 'empty'}: pretrain.data[0]: no images" in text


def test_kitti_folder_without_objects_to_crop_is_named(tmp_path, caplog):
    root = write_kitti(tmp_path / "kitti", {"a": kitti_line("car", 10, 10, 14, 14), "b": kitti_line("DontCare")})
    text = _pretrain_error(tmp_path, caplog, root)
    assert f"{root}: pretrain.data[0]: no labelled objects to crop (1 objects" in text


def test_corrupt_image_is_named(tmp_path, caplog):
    tree = _write_tree(tmp_path / "tree", {"a": [(1, 2, 3)] * 2, "b": [(3, 2, 1)] * 2})
    (tree / "b" / "bad.jpg").write_bytes(Image.new("RGB", (40, 30)).tobytes()[:200])
    text = _pretrain_error(tmp_path, caplog, tree)
    assert f"{tree / 'b' / 'bad.jpg'}: corrupt or unreadable image" in text
