"""The `traffic` synthetic set (data/synth/traffic.py): crowded, imbalanced, multi-scale street scenes whose KITTI
occluded/truncated fields are what the generator drew."""

from __future__ import annotations

import collections
import typing

import numpy as np
import pytest

from qatpipe.data.kitti import ClassMap, read_kitti_dataset
from qatpipe.data.synth import KINDS, traffic, write_synthetic_dataset

H, W = 192, 320
SEED = 7


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """70 train images (~400 boxes) at the default image size, through the writer, read back by the strict reader."""
    root = tmp_path_factory.mktemp("traffic")
    summary = write_synthetic_dataset(root, num_train=70, num_val=4, seed=SEED, image_height=H, image_width=W,
                                      kind="traffic", workers=1)
    samples = read_kitti_dataset(root / "train", ClassMap.create(traffic.TRAFFIC_CLASSES), tolerance=0.0)
    return root, summary, samples


@pytest.fixture(scope="module")
def generated():
    """The same train images from the generator itself: (image, objects with their masks) per index."""
    return [traffic.generate_traffic(np.random.default_rng([SEED, 0, i]), H, W) for i in range(70)]


def test_labels_load_and_count_2_to_10_objects_per_image(written):
    root, summary, samples = written
    assert (root / "classes.txt").read_text().split() == list(traffic.TRAFFIC_CLASSES)
    assert len(samples) == 70 and all((s.width, s.height) == (W, H) for s in samples)
    per_image = [len(s.classes) for s in samples]
    assert min(per_image) >= 2 and max(per_image) <= 10
    assert max(per_image) >= 9 and np.mean(per_image) > 4  # crowded
    assert summary["splits"]["train"]["objects"] == sum(per_image)


def test_box_widths_span_16_to_80_px_with_a_third_under_28(written):
    boxes = np.concatenate([s.boxes for s in written[2]])
    widths = boxes[:, 2] - boxes[:, 0]
    assert len(widths) >= 300
    assert 16.0 - 0.01 <= widths.min() < 19.0 and 72.0 < widths.max() <= 80.0 + 0.01
    assert 0.22 <= (widths < 28).mean() <= 0.40
    assert np.all(boxes[:, 3] - boxes[:, 1] >= 4.0)


def test_classes_are_imbalanced(written):
    counts = written[1]["splits"]["train"]["per_class"]
    assert all(counts.values())  # every class appears in ~400 boxes
    assert max(counts, key=counts.get) == "car"
    assert counts["car"] >= 4 * min(counts.values())


def test_written_labels_are_the_generator_objects(written, generated):
    root = written[0]
    for i, (_, objects) in enumerate(generated[:20]):
        lines = (root / "train" / "labels" / f"{i:06d}.txt").read_text().splitlines()
        assert [(f.split()[0], float(f.split()[1]), int(f.split()[2])) for f in lines] == [
            (o["class"], o["truncated"], o["occluded"]) for o in objects]


def _in_image(obj) -> tuple[np.ndarray, np.ndarray]:
    """The object's silhouette placed on an HxW canvas, and how many of its pixels there are in all."""
    ox, oy = obj["origin"]
    canvas = np.zeros((H, W), bool)
    mask = obj["mask"]
    y0, x0 = max(0, oy), max(0, ox)
    y1, x1 = min(H, oy + mask.shape[0]), min(W, ox + mask.shape[1])
    canvas[y0:y1, x0:x1] = mask[y0 - oy:y1 - oy, x0 - ox:x1 - ox]
    return canvas, int(mask.sum())


def test_occluded_is_the_hidden_fraction_of_the_drawn_masks(generated):
    levels = collections.Counter()
    for _, objects in generated:
        masks = [_in_image(o)[0] for o in objects]  # listed back to front
        for k, obj in enumerate(objects):
            front = np.logical_or.reduce(masks[k + 1:]) if k + 1 < len(masks) else np.zeros((H, W), bool)
            hidden = (masks[k] & front).sum() / masks[k].sum()
            assert hidden == pytest.approx(obj["hidden"], abs=1e-9)
            assert hidden <= traffic.MAX_HIDDEN + 1e-9
            assert obj["occluded"] == (0 if hidden < 0.05 else 1 if hidden < 0.25 else 2)
            levels[obj["occluded"]] += 1
    assert levels[1] >= 20 and levels[2] >= 20  # occlusion happens, up to the cap
    assert max(o["hidden"] for _, objects in generated for o in objects) > 0.35


def test_truncated_is_the_cut_off_fraction_of_edge_objects(generated):
    edge = 0
    for _, objects in generated:
        for obj in objects:
            inside, total = _in_image(obj)
            cut = 1.0 - inside.sum() / total
            assert obj["truncated"] == (round(cut, 2) if cut >= 0.005 else 0.0)
            x1, y1, x2, y2 = obj["box"]
            at_edge = x1 == 0 or y1 == 0 or x2 == W or y2 == H
            if obj["truncated"] > 0:
                edge += 1
                assert at_edge
            elif not at_edge:
                assert cut == 0.0
    assert edge >= 30 and max(o["truncated"] for _, objects in generated for o in objects) >= 0.3


def test_objects_stand_on_one_ground_plane_back_to_front(generated):
    """Bottom edge = horizon + box height x camera height / class height (+- jitter): far objects are smaller and
    higher, and each image lists (paints) them from the highest bottom edge down."""
    metres = {cls: m for cls, (_, _, m) in traffic._CLASSES.items()}
    for _, objects in generated:
        bottoms = [o["box"][3] for o in objects]
        assert all(b - a >= -1.0 for a, b in zip(bottoms, bottoms[1:]))
        horizons = [o["box"][3] - (o["box"][3] - o["box"][1]) * traffic.CAMERA_HEIGHT_M / metres[o["class"]]
                    for o in objects if o["truncated"] == 0]  # a cut object's box is not its whole height
        if horizons:
            assert max(horizons) - min(horizons) <= 2 * traffic._GROUND_JITTER * H + 1.0
            assert H * traffic._HORIZON[0] - 6 <= np.mean(horizons) <= H * traffic._HORIZON[1] + 6


def test_same_seed_same_bytes(tmp_path):
    write_synthetic_dataset(tmp_path / "a", 8, 2, seed=3, kind="traffic", workers=1)
    write_synthetic_dataset(tmp_path / "b", 8, 2, seed=3, kind="traffic", workers=2)
    write_synthetic_dataset(tmp_path / "c", 8, 2, seed=4, kind="traffic", workers=1)
    files = sorted(p.relative_to(tmp_path / "a") for p in (tmp_path / "a").rglob("*") if p.is_file())
    assert len(files) == 2 * (8 + 2) + 1
    for rel in files:
        assert (tmp_path / "a" / rel).read_bytes() == (tmp_path / "b" / rel).read_bytes(), rel
    assert (tmp_path / "a" / "train" / "images" / "000000.jpg").read_bytes() != (
        tmp_path / "c" / "train" / "images" / "000000.jpg").read_bytes()


def test_sizes_scale_with_the_image(tmp_path):
    write_synthetic_dataset(tmp_path, 10, 1, seed=1, image_height=96, image_width=160, kind="traffic", workers=1)
    samples = read_kitti_dataset(tmp_path / "train", ClassMap.create(traffic.TRAFFIC_CLASSES), tolerance=0.0)
    boxes = np.concatenate([s.boxes for s in samples])
    widths = boxes[:, 2] - boxes[:, 0]
    assert 8.0 - 0.01 <= widths.min() and widths.max() <= 40.0 + 0.01


def test_the_spec_offers_every_kind_and_its_traffic_set_is_the_generators(tmp_path):
    """Every kind is a spec value; a spec naming traffic (and a seed and size) prepares the generator's scenes,
    measured from the labels written."""
    from qatpipe.data.prepare import prepare_dataset
    from qatpipe.spec import SyntheticDataSpec, bundled_spec_path, load_spec

    assert set(typing.get_args(SyntheticDataSpec.model_fields["kind"].annotation)) == set(KINDS)
    spec = load_spec(bundled_spec_path("tiny"), [
        "dataset.synthetic.kind=traffic", f"dataset.synthetic.seed={SEED}", "dataset.synthetic.train_images=3",
        "dataset.synthetic.val_images=1", f"dataset.image_size.height={H}", f"dataset.image_size.width={W}",
        f"dataset.classes=[{', '.join(traffic.TRAFFIC_CLASSES)}]"])
    prepare_dataset(spec, tmp_path)
    samples = read_kitti_dataset(tmp_path / "train", ClassMap.create(traffic.TRAFFIC_CLASSES), tolerance=0.0)
    assert len(samples) == 3
    for i, sample in enumerate(samples):
        _, objects = traffic.generate_traffic(np.random.default_rng([SEED, 0, i]), H, W)
        assert [traffic.TRAFFIC_CLASSES[c] for c in sample.classes] == [o["class"] for o in objects]
        np.testing.assert_allclose(sample.boxes, [o["box"] for o in objects], atol=0.01)
