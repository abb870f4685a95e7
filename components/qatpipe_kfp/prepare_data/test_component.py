import json
from pathlib import Path

import pytest
from kfp import dsl

from qatpipe.errors import DataError
from qatpipe_kfp.prepare_data.component import prepare_data

SMALL = "dataset:\n  classes: [car, pedestrian, cyclist]\n  synthetic: {train_images: 6, val_images: 3, seed: 1}\n"


def test_generates_synthetic_data_with_a_manifest_and_report(artifact):
    dataset, report = artifact(dsl.Dataset, "dataset"), artifact(dsl.Markdown, "report")
    prepare_data.python_func(data_spec=SMALL, dataset=dataset, report=report)
    manifest = json.loads((Path(dataset.path) / "dataset.json").read_text())
    assert manifest["source"] == "synthetic" and manifest["counts"]["train"]["images"] == 6
    assert len(list((Path(dataset.path) / "val" / "images").iterdir())) == 3
    assert dataset.metadata["val_images"] == 3
    assert "| car |" in Path(report.path).read_text()
    assert Path(report.path).read_text() == (Path(dataset.path) / "report.md").read_text()  # the stage's report
    record = json.loads((Path(dataset.path) / "tracking.json").read_text())
    assert record["stage"] == "prepare_data" and "report.md" in record["artifacts"]


def test_named_folder_that_is_missing_fails_with_its_path(artifact, tmp_path):
    spec = SMALL + f"  train: {tmp_path}/nope/train\n  val: {tmp_path}/nope/val\n"
    with pytest.raises(DataError, match="nope/train: dataset.train: dataset folder not found"):
        prepare_data.python_func(data_spec=spec, dataset=artifact(dsl.Dataset, "dataset"),
                                 report=artifact(dsl.Markdown, "report"))
