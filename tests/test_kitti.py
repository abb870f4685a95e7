"""KITTI reader: every bad input is an error that names the file and line; good input parses exactly."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import kitti_line, write_kitti
from qatpipe.data.kitti import ClassMap, read_kitti_dataset
from qatpipe.errors import DataError

CLASS_MAP = ClassMap.create(["car", "pedestrian"], {"van": "car"}, ["DontCare"])


def read(root, tolerance=2.0):
    return read_kitti_dataset(root, CLASS_MAP, tolerance=tolerance, key="dataset.train")


def test_valid_labels_parse_with_mapping_ignore_and_case(tmp_path):
    text = "\n".join([
        kitti_line("Car", 10, 20, 50, 60),
        kitti_line("van", 0, 0, 160, 96),
        kitti_line("DontCare", 1, 1, 5, 5),
        kitti_line("pedestrian", 100.5, 10.25, 120, 90),
        "",
    ])
    samples = read(write_kitti(tmp_path, {"000001": text}))
    assert len(samples) == 1
    sample = samples[0]
    assert (sample.width, sample.height) == (160, 96)
    np.testing.assert_allclose(sample.boxes, [[10, 20, 50, 60], [0, 0, 160, 96], [100.5, 10.25, 120, 90]])
    assert sample.classes.tolist() == [0, 0, 1]


def test_box_within_tolerance_is_clipped(tmp_path):
    samples = read(write_kitti(tmp_path, {"a": kitti_line("car", -1.5, 0, 161.5, 97)}))
    np.testing.assert_allclose(samples[0].boxes, [[0, 0, 160, 96]])


@pytest.mark.parametrize(
    "line, reason",
    [
        ("car 0 0 0 10 20 50", "expected 15 KITTI fields, found 7"),
        (kitti_line("car") + " 0.9", "expected 15 KITTI fields, found 16"),
        ("car 0.00 0 0.00 10 20 fifty 60 0 0 0 0 0 0 0", "field 7 is not a number: 'fifty'"),
        ("car 0.00 0 0.00 10 20 nan 60 0 0 0 0 0 0 0", "field 7 is not a finite number: 'nan'"),
        (kitti_line("car", 50, 20, 10, 60), "degenerate box"),
        (kitti_line("car", 10, 60, 50, 60), "degenerate box"),
        (kitti_line("car", 10, 20, 170, 60), "outside the 160x96 image"),
        (kitti_line("car", -5, 20, 50, 60), "outside the 160x96 image"),
        (kitti_line("truck"), "unknown class 'truck'"),
    ],
)
def test_bad_label_line_names_file_and_line(tmp_path, line, reason):
    root = write_kitti(tmp_path, {"000007": kitti_line("car") + "\n\n" + line + "\n"})
    with pytest.raises(DataError) as info:
        read(root)
    message = str(info.value)
    assert f"{root / 'labels' / '000007.txt'}:3: " in message
    assert reason in message
    assert info.value.line == 3


def test_corrupt_image_names_the_image(tmp_path):
    root = write_kitti(tmp_path, {"ok": kitti_line(), "bad": kitti_line()},
                       image_bytes={"bad": b"\xff\xd8\xff\xe0 this is not really a jpeg"})
    with pytest.raises(DataError, match=r"bad\.jpg: corrupt or unreadable image"):
        read(root)


def test_truncated_image_is_caught(tmp_path):
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.effect_noise((160, 96), 50).convert("RGB").save(buffer, "JPEG")
    root = write_kitti(tmp_path, {"cut": kitti_line()}, image_bytes={"cut": buffer.getvalue()[:600]})
    with pytest.raises(DataError, match=r"cut\.jpg: corrupt or unreadable image"):
        read(root)


def test_missing_label_file_and_orphan_label(tmp_path):
    root = write_kitti(tmp_path / "a", {"x": kitti_line()})
    (root / "labels" / "x.txt").unlink()
    with pytest.raises(DataError, match=r"x\.txt: label file not found for image x\.jpg"):
        read(root)
    root = write_kitti(tmp_path / "b", {"y": kitti_line()})
    (root / "images" / "y.jpg").unlink()
    (root / "images" / "z.jpg").write_bytes((tmp_path / "a" / "images" / "x.jpg").read_bytes())
    with pytest.raises(DataError, match=r"y\.txt: label file has no image"):
        read(root)


def test_missing_folders_name_the_spec_key(tmp_path):
    with pytest.raises(DataError, match=r"dataset\.train: dataset folder not found"):
        read(tmp_path / "nope")
    (tmp_path / "only_images" / "images").mkdir(parents=True)
    with pytest.raises(DataError, match=r"labels: dataset\.train: missing folder"):
        read(tmp_path / "only_images")


def test_windows_line_endings_and_bom_are_accepted(tmp_path):
    text = "\ufeff" + kitti_line("car", 10, 20, 50, 60) + "\r\n" + kitti_line("pedestrian", 60, 10, 80, 90) + "\r\n"
    root = write_kitti(tmp_path, {"w": ""})
    (root / "labels" / "w.txt").write_bytes(text.encode("utf-8"))
    sample = read(root)[0]
    assert sample.classes.tolist() == [0, 1]
    np.testing.assert_allclose(sample.boxes, [[10, 20, 50, 60], [60, 10, 80, 90]])


@pytest.mark.parametrize("box", [(160.5, 10, 161.5, 20), (-1.8, 10, -0.5, 20)])
def test_box_entirely_in_the_tolerance_band_is_an_error(tmp_path, box):
    root = write_kitti(tmp_path, {"e": kitti_line("car", *box)})
    with pytest.raises(DataError, match=r"e\.txt:1: box .* has no area inside the 160x96 image"):
        read(root)


def test_image_format_tensorflow_cannot_decode(tmp_path):
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (160, 96)).save(buffer, "TIFF")
    root = write_kitti(tmp_path, {"t": kitti_line()}, image_bytes={"t": buffer.getvalue()})
    with pytest.raises(DataError, match=r"t\.jpg: TIFF image: the input pipeline reads BMP, GIF, JPEG, PNG, WEBP"):
        read(root)


def test_two_images_with_one_name(tmp_path):
    from PIL import Image

    root = write_kitti(tmp_path, {"a": kitti_line()})
    Image.new("RGB", (640, 480)).save(root / "images" / "a.png")
    with pytest.raises(DataError, match=r"a\.png: dataset\.train: a\.jpg has the same name"):
        read(root)
