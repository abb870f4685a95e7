import pytest

from qatpipe.errors import DataError
from qatpipe_kfp.fingerprint_data.component import fingerprint_data

CLASSES = "dataset:\n  classes: [car]\n"


def _spec(root) -> str:
    return CLASSES + f"  train: {root / 'train'}\n  val: {root / 'val'}\n"


def test_the_fingerprint_follows_the_files_and_not_the_spec_alone(tmp_path):
    for split in ("train", "val"):
        (tmp_path / split / "images").mkdir(parents=True)
        (tmp_path / split / "images" / "a.jpg").write_bytes(b"pixels")
    first = fingerprint_data.python_func(data_spec=_spec(tmp_path))
    assert len(first) == 16 and fingerprint_data.python_func(data_spec=_spec(tmp_path)) == first
    (tmp_path / "train" / "images" / "b.jpg").write_bytes(b"more")  # a new file under the same folder
    second = fingerprint_data.python_func(data_spec=_spec(tmp_path))
    (tmp_path / "train" / "images" / "b.jpg").write_bytes(b"mora")  # same size, other bytes
    assert len({first, second, fingerprint_data.python_func(data_spec=_spec(tmp_path))}) == 3


def test_synthetic_data_is_decided_by_the_spec(tmp_path):
    assert fingerprint_data.python_func(data_spec=CLASSES) == "synthetic"


def test_a_missing_folder_is_named(tmp_path):
    with pytest.raises(DataError, match=r"nope/train: dataset.train: dataset folder not found"):
        fingerprint_data.python_func(data_spec=CLASSES + f"  train: {tmp_path}/nope/train\n  val: {tmp_path}\n")
