"""The backbone start the package ships (`model.pretrained: qatpipe:<name>`, issue 55): its card matches its
file, it loads into the default spec's detector whole, and a bad name, another backbone or a changed file is
refused naming the key, the file or the starts that fit."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest

import qatpipe.weights as weights
from qatpipe.errors import ModelFileError, SpecError
from qatpipe.spec import bundled_spec_path, load_spec

NAME = "resnet10-0.5-shapes-photos"


def test_the_card_describes_its_file_and_the_default_spec_uses_it():
    start = weights.catalogue()[NAME]
    card = start.card
    assert weights.sha256(start.path) == card["sha256"] and start.path.stat().st_size == card["bytes"]
    assert card["backbone"] == {"name": "resnet", "depth": 10, "width": 0.5, "all_projections": True}
    assert card["top1"] > 2 * card["chance"]  # a classifier that learned, not chance
    assert any("qatpipe pretrain" in command for command in card["commands"])
    assert "not an ImageNet replacement" in card["what"]
    assert load_spec(bundled_spec_path("default")).model.pretrained == f"qatpipe:{NAME}"


def test_the_packaged_start_loads_every_backbone_layer_of_the_default_detector():
    from qatpipe.models import get_architecture
    from qatpipe.models.pretrained import load_pretrained, read_weights, resolve_pretrained

    spec = load_spec(bundled_spec_path("default"))
    path = resolve_pretrained(spec.model.pretrained, spec.model.backbone)
    assert path == str(weights.catalogue()[NAME].path)
    model = get_architecture(spec).build_model()
    report = load_pretrained(model, path, spec.model.backbone)
    assert report.random_backbone == [] and report.skipped == []
    assert len(report.loaded) > 20
    stored = read_weights(path)
    for name in report.loaded[:5]:
        for got, want in zip(model.get_layer(name).get_weights(), stored[name]):
            np.testing.assert_array_equal(got, want)


def test_an_unknown_name_lists_the_packaged_starts():
    with pytest.raises(SpecError, match=rf"'qatpipe:nosuch' is not a packaged start; the package has qatpipe:{NAME}"):
        load_spec(bundled_spec_path("default"), ["model.pretrained=qatpipe:nosuch"])


def test_a_start_for_another_backbone_says_which_backbone_it_fits():
    with pytest.raises(SpecError, match=r"fits the backbone name resnet, depth 10, width 0.5.*width 0.5 \(the spec "
                                        r"has 0.25\)"):
        load_spec(bundled_spec_path("default"), ["model.backbone.width=0.25"])
    with pytest.raises(SpecError, match=r"name 'resnet' \(the spec has 'mobilenet_v2'\)"):
        load_spec(bundled_spec_path("default"), ["model.backbone.name=mobilenet_v2"])


def test_a_file_that_differs_from_its_card_is_refused_naming_it(tmp_path, monkeypatch):
    start = weights.catalogue()[NAME]
    shutil.copyfile(start.path, tmp_path / start.card["file"])
    (tmp_path / f"{NAME}.json").write_text(json.dumps(start.card))
    with open(tmp_path / start.card["file"], "r+b") as handle:  # one byte changed in the middle
        handle.seek(start.card["bytes"] // 2)
        byte = handle.read(1)
        handle.seek(-1, 1)
        handle.write(bytes([byte[0] ^ 0xFF]))
    monkeypatch.setattr(weights, "FOLDER", tmp_path)
    weights.catalogue.cache_clear()
    try:
        with pytest.raises(ModelFileError, match=rf"{NAME}.keras has SHA-256 [0-9a-f]{{64}}, but its card {NAME}.json"):
            weights.lookup(f"qatpipe:{NAME}").verified_path()
        (tmp_path / start.card["file"]).unlink()
        with pytest.raises(ModelFileError, match="weights file .* is missing from the installed package"):
            weights.lookup(f"qatpipe:{NAME}").verified_path()
    finally:
        weights.catalogue.cache_clear()


def test_the_cli_refuses_an_unknown_start_with_exit_2_and_no_traceback():
    result = subprocess.run([sys.executable, "-m", "qatpipe.cli", "spec", "show", "-e", "default", "--set",
                             "model.pretrained=qatpipe:nosuch"], capture_output=True, text=True)
    assert result.returncode == 2, result.stderr
    assert f"qatpipe:{NAME}" in result.stderr and "Traceback" not in result.stderr
