"""The `traffic_night` synthetic set (data/synth/night.py): traffic's scenes and labels, with a night picture."""

from __future__ import annotations

import numpy as np

from qatpipe.data.kitti import ClassMap, read_kitti_dataset
from qatpipe.data.synth import night, traffic, write_synthetic_dataset

H, W = 192, 320


def test_labels_are_the_day_scenes_and_the_writer_is_reproducible(tmp_path):
    write_synthetic_dataset(tmp_path / "day", 12, 2, seed=5, kind="traffic", workers=1)
    write_synthetic_dataset(tmp_path / "night", 12, 2, seed=5, kind="traffic_night", workers=1)
    write_synthetic_dataset(tmp_path / "night2", 12, 2, seed=5, kind="traffic_night", workers=2)
    class_map = ClassMap.create(traffic.TRAFFIC_CLASSES)
    for split in ("train", "val"):
        day = read_kitti_dataset(tmp_path / "day" / split, class_map, tolerance=0.0)
        dark = read_kitti_dataset(tmp_path / "night" / split, class_map, tolerance=0.0)
        assert len(day) == len(dark) > 0
        for a, b in zip(day, dark):
            assert np.array_equal(a.boxes, b.boxes) and np.array_equal(a.classes, b.classes)
        for path in sorted((tmp_path / "night" / split / "images").iterdir()):
            assert path.read_bytes() == (tmp_path / "night2" / split / "images" / path.name).read_bytes()
    assert (tmp_path / "night" / "classes.txt").read_text().split() == list(traffic.TRAFFIC_CLASSES)


def test_the_picture_is_dark_and_noisy_and_lamps_saturate():
    means, lit, lamps_on_vehicles = [], 0, 0
    for i in range(24):
        day, objects = traffic.generate_traffic(np.random.default_rng([3, 0, i]), H, W)
        dark, same = night.generate_traffic_night(np.random.default_rng([3, 0, i]), H, W)
        assert [o["box"] for o in same] == [o["box"] for o in objects]
        means.append(dark.mean() / day.mean())
        saturated = (dark >= 250).all(axis=-1) | (dark[..., 0] >= 250)  # white headlights, street lamps; red tails
        lit += saturated.any()
        for o in objects:
            if o["class"] != "pedestrian":
                x1, y1, x2, y2 = (int(round(v)) for v in o["box"])
                lamps_on_vehicles += saturated[y1:y2 + 1, x1:x2 + 1].any()
    assert max(means) < 0.3 and float(np.mean(means)) < 0.2  # about a tenth of the day's mean grey
    assert lit >= 20 and lamps_on_vehicles >= 24


def test_a_lamp_lies_only_on_its_vehicle_silhouette():
    mask = np.zeros((4, 6), bool)
    mask[1:3, 2:5] = True
    obj = {"mask": mask, "origin": (10, 20)}
    assert night._on_silhouette(obj, 13.5, 21.2)
    assert not night._on_silhouette(obj, 11.0, 21.0)  # left of the drawn part
    assert not night._on_silhouette(obj, 13.0, 30.0)  # below the mask


def test_a_spec_naming_the_kind_prepares_night_pictures_of_the_day_scenes(tmp_path):
    """A spec with dataset.synthetic.kind traffic_night prepares what the night generator draws: the day kind's
    labels, in pictures measured about a tenth as bright."""
    from PIL import Image

    from qatpipe.data.prepare import prepare_dataset
    from qatpipe.spec import bundled_spec_path, load_spec

    def prepared(kind):
        spec = load_spec(bundled_spec_path("tiny"), [
            f"dataset.synthetic.kind={kind}", "dataset.synthetic.seed=3", "dataset.synthetic.train_images=4",
            "dataset.synthetic.val_images=1", f"dataset.image_size.height={H}", f"dataset.image_size.width={W}",
            f"dataset.classes=[{', '.join(traffic.TRAFFIC_CLASSES)}]"])
        prepare_dataset(spec, tmp_path / kind)
        samples = read_kitti_dataset(tmp_path / kind / "train", ClassMap.create(traffic.TRAFFIC_CLASSES), 0.0)
        return samples, [float(np.asarray(Image.open(s.image_path)).mean()) for s in samples]

    (day, day_means), (dark, dark_means) = prepared("traffic"), prepared("traffic_night")
    assert len(day) == len(dark) == 4
    for a, b in zip(day, dark):
        assert np.array_equal(a.boxes, b.boxes) and np.array_equal(a.classes, b.classes)
    ratios = np.array(dark_means) / np.array(day_means)
    assert ratios.max() < 0.3 and ratios.mean() < 0.2
