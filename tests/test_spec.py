"""Spec validation: unknown keys, wrong types, missing keys and files are errors naming the key or path."""

from __future__ import annotations

import pytest
import yaml

from qatpipe.errors import SpecError
from qatpipe.spec import apply_overrides, bundled_spec_path, flatten, load_spec, parse_spec

MINIMAL = {"dataset": {"train": "a", "val": "b", "classes": ["car"]}}
DETECTNET = {"model": {"arch": "detectnet_v2"}}  # the tests of DetectNet_v2's keys name it: the default is SSD


def write(tmp_path, data) -> str:
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


@pytest.mark.parametrize("name, arch", [("default", "ssd"), ("full", "ssd"), ("tiny", "detectnet_v2")])
def test_bundled_specs_are_valid(name, arch):
    spec = load_spec(bundled_spec_path(name))
    assert spec.dataset.classes == ["car", "pedestrian", "cyclist"]
    assert spec.model.arch == arch


def test_the_full_spec_evaluates_on_2000_val_images_and_validates_during_training_on_300():
    """Issue 37: the final evaluations' CIs need the large val set; each epoch's validation keeps a fixed 300."""
    spec = load_spec(bundled_spec_path("full"))
    assert spec.dataset.synthetic.val_images == 2000 and spec.train.val_images == 300


def test_the_quick_default_does_at_most_20000_training_image_passes_and_full_keeps_its_64000():
    from qatpipe.stages.retrain_plan import training_epochs

    default, full = (load_spec(bundled_spec_path(name)) for name in ("default", "full"))
    assert default.dataset.synthetic.train_images * training_epochs(default) == 20_000  # 6 + 3 + 0 + 1 epochs
    assert full.dataset.synthetic.train_images * training_epochs(full) == 64_000  # 14 + 8 + 8 + 2
    # the other orders: TAO's (QAT retrains the pruned model, the FP32 retrain handed on), and fp32's (QAT as long
    # as the FP32 fine-tuning beside it)
    assert training_epochs(load_spec(bundled_spec_path("full"), ["qat.start=pruned"])) == 14 + 8 + 8
    assert training_epochs(load_spec(bundled_spec_path("full"), ["qat.start=fp32", "qat.finetune_epochs=3"])) == \
        14 + 8 + 3 + 3
    assert default.model.pretrained == "qatpipe:resnet10-0.5-shapes-photos" and full.model.pretrained is None


def test_a_spec_naming_only_its_data_runs_the_default_recipe(tmp_path):
    """Issue 58, one spec truth: the schema's defaults are the bundled default recipe, so a spec of only
    `dataset:` resolves as `--spec default` does (with default.yaml's data keys, to the letter; with other data,
    every section but dataset)."""
    default = load_spec(bundled_spec_path("default"))
    data = yaml.safe_load(bundled_spec_path("default").read_text())["dataset"]
    assert load_spec(write(tmp_path, {"dataset": data})).to_dict() == default.to_dict()
    own = parse_spec(MINIMAL).to_dict()
    assert {k: v for k, v in own.items() if k != "dataset"} == \
        {k: v for k, v in default.to_dict().items() if k != "dataset"}
    assert (default.model.arch, default.model.backbone.width, default.train.epochs, default.prune.target_flops_ratio) \
        == ("ssd", 0.5, 6, 0.5)
    assert default.dataset.ignore_classes == parse_spec(MINIMAL).dataset.ignore_classes == ["DontCare"]


def test_a_threshold_or_start_written_alone_keeps_its_meaning():
    """The default FLOPs target and finetune_epochs 0 are the default recipe's: a prune section giving only a
    threshold prunes at it (as `-pth` does), a qat section naming another start fine-tunes for retrain.epochs."""
    spec = parse_spec({**MINIMAL, "prune": {"threshold": 0.3}, "qat": {"start": "fp32"}})
    assert (spec.prune.threshold, spec.prune.target_flops_ratio, spec.qat.finetune_epochs) == (0.3, None, None)
    both = parse_spec({**MINIMAL, "prune": {"threshold": 0.3, "target_flops_ratio": 0.4},
                       "qat": {"start": "fp32", "finetune_epochs": 2}})
    assert (both.prune.target_flops_ratio, both.qat.finetune_epochs) == (0.4, 2)
    with pytest.raises(SpecError, match="finetune_epochs 0 .*needs start: baseline"):
        parse_spec({**MINIMAL, "qat": {"start": "fp32", "finetune_epochs": 0}})


def test_defaults_fill_every_section():
    spec = parse_spec(MINIMAL)
    assert spec.train.epochs == 6 and spec.model.backbone.depth == 10
    assert spec.validate_.max_map_drop == 0.01
    assert spec.train.validation_interval == 1 and spec.train.keep == "best"
    assert spec.train.val_images == 300 and spec.dataset.synthetic.val_images == 2000
    assert set(spec.to_dict()) == {"dataset", "model", "augmentation", "pretrain", "train", "evaluate", "prune", "retrain", "qat", "ptq",
                                   "sensitivity", "export", "engine", "validate", "tracking"}


@pytest.mark.parametrize(
    "patch, expected",
    [
        ({"train": {"epochz": 3}}, "train.epochz: unknown key (did you mean train.epochs?)"),
        ({"model": {"backbone": {"depth": 11}}}, "model.backbone.depth: must be 10, 18 or 34 (got 11)"),
        ({"train": {"batch_size": "big"}}, "train.batch_size: must be an integer (got 'big')"),
        ({"train": {"learning_rate": {"min_lr": 1.0, "max_lr": 0.1}}}, "min_lr (1.0) > max_lr (0.1)"),
        ({"dataset": {**MINIMAL["dataset"], "image_size": {"height": 100, "width": 160}}, **DETECTNET},
         "must be a multiple of 16, model.arch detectnet_v2"),
        ({"dataset": {**MINIMAL["dataset"], "image_size": {"height": 96, "width": 160}}},
         "must be a multiple of 64, model.arch ssd"),
        ({"dataset": {**MINIMAL["dataset"], "class_mapping": {"van": "truck"}}}, "names not in classes: ['truck']"),
        ({"validate": {"max_map_dropp": 1}}, "validate.max_map_dropp: unknown key"),
        ({"train": {"keep": "worst"}}, "train.keep: must be 'best' or 'last' (got 'worst')"),
        ({"train": {"validation_interval": -1}}, "train.validation_interval: must be >= 0 (got -1)"),
        ({"train": {"val_images": 0}}, "train.val_images: must be >= 1 (got 0)"),
        ({"model": {"arch": "yolo"}}, "model.arch: must be one of: detectnet_v2, ssd (got 'yolo')"),
        ({"model": {"arch": "detectnet_v2", "decoder": {"methd": "nms"}}}, "model.decoder.methd: unknown key"),
    ],
)
def test_invalid_values_name_the_key(tmp_path, patch, expected):
    data = {**MINIMAL, **patch}
    with pytest.raises(SpecError) as info:
        load_spec(write(tmp_path, data))
    assert str(tmp_path / "spec.yaml") in str(info.value)
    assert expected in str(info.value)


def test_the_model_section_is_the_architectures_own():
    """model.arch picks the section's schema (DetectNet_v2's target, decoder and loss); absent, the default
    architecture's (the default recipe's SSD); every architecture the spec knows has a model builder."""
    from qatpipe.models import get_architecture
    from qatpipe.spec import ARCHITECTURE_SPECS, DEFAULT_ARCH, SsdSpec

    spec = parse_spec(MINIMAL)
    assert type(spec.model) is SsdSpec and spec.model.arch == DEFAULT_ARCH == "ssd"
    assert parse_spec({**MINIMAL, "model": {"arch": "detectnet_v2", "loss": {"class_weight": 0.5}}}).model.loss \
        .class_weight == 0.5
    for arch, section in ARCHITECTURE_SPECS.items():
        with_arch = parse_spec({**MINIMAL, "model": {"arch": arch}})
        assert type(with_arch.model) is section and get_architecture(with_arch).spec is with_arch


def test_missing_required_key(tmp_path):
    with pytest.raises(SpecError, match=r"dataset\.classes: required key is missing"):
        load_spec(write(tmp_path, {"dataset": {"train": "a", "val": "b"}}))


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(SpecError, match=r"nope\.yaml: spec file not found"):
        load_spec(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("dataset: [unclosed\n")
    with pytest.raises(SpecError, match=r"bad\.yaml: not valid YAML"):
        load_spec(bad)
    with pytest.raises(SpecError, match="no bundled spec named 'huge': the bundled ones are default, full, tiny"):
        bundled_spec_path("huge")


def test_overrides_parse_yaml_values(tmp_path):
    spec = load_spec(write(tmp_path, {**MINIMAL, **DETECTNET}), [
        "train.epochs=7", "train.learning_rate.max_lr=0.01", "dataset.classes=[a, b]", "train.use_amp=true",
        "model.decoder.method=dbscan",
    ])
    assert spec.train.epochs == 7 and spec.train.learning_rate.max_lr == 0.01
    assert spec.dataset.classes == ["a", "b"] and spec.train.use_amp is True
    assert spec.model.decoder.method == "dbscan"


def test_bad_overrides(tmp_path):
    path = write(tmp_path, MINIMAL)
    with pytest.raises(SpecError, match="expected KEY.PATH=VALUE"):
        load_spec(path, ["train.epochs"])
    with pytest.raises(SpecError, match="train.epochs is not a section"):
        load_spec(write(tmp_path, {**MINIMAL, "train": {"epochs": 3}}), ["train.epochs.x=1"])
    with pytest.raises(SpecError, match="train.nope: unknown key"):
        load_spec(path, ["train.nope=1"])


def test_apply_overrides_does_not_mutate_and_flatten():
    data = {"a": {"b": 1}}
    assert apply_overrides(data, ["a.c=2"]) == {"a": {"b": 1, "c": 2}}
    assert data == {"a": {"b": 1}}
    assert flatten({"a": {"b": 1, "c": {"d": [1]}}, "e": 2}) == {"a.b": 1, "a.c.d": [1], "e": 2}


def test_non_utf8_file_is_a_spec_error(tmp_path):
    path = tmp_path / "bin.yaml"
    path.write_bytes(b"\x7fELF\x02\x01\x01\x00\xff\xfe\x80\x00")  # like `head -c 100 /bin/ls`
    with pytest.raises(SpecError, match=r"bin\.yaml: not a UTF-8 text file"):
        load_spec(path)


def test_unreadable_file_is_a_spec_error(tmp_path, monkeypatch):
    path = tmp_path / "spec.yaml"
    path.write_text("dataset: {}\n")

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(type(path), "read_text", refuse)
    with pytest.raises(SpecError, match=r"spec\.yaml: cannot read the spec file: Permission denied"):
        load_spec(path)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("dataset: {train: a, val: b, classes: [car]}\ntrain: {epochs: 3}\ntrain: {batch_size: 4}\n",
         "spec.yaml:3: duplicate key 'train' (first at line 2)"),
        ("dataset: {train: a, val: b, classes: [car]}\ntrain:\n  epochs: 3\n  seed: 1\n  epochs: 4\n",
         "spec.yaml:5: duplicate key 'epochs' (first at line 3)"),
        ("dataset:\n  train: a\n  val: b\n  classes: [car]\n  class_mapping: {van: car, van: car}\n",
         "spec.yaml:5: duplicate key 'van' (first at line 5)"),
    ],
)
def test_duplicate_yaml_keys_are_errors(tmp_path, text, expected):
    path = tmp_path / "spec.yaml"
    path.write_text(text)
    with pytest.raises(SpecError) as info:
        load_spec(path)
    assert expected in str(info.value)


def test_yaml_merge_keys_may_be_overridden(tmp_path):
    path = tmp_path / "spec.yaml"
    path.write_text(
        "dataset: {train: a, val: b, classes: [car]}\n"
        "evaluate: &common {batch_size: 4}\n"
        "train: {<<: *common, batch_size: 8}\n"
    )
    spec = load_spec(path)
    assert spec.evaluate.batch_size == 4 and spec.train.batch_size == 8


@pytest.mark.parametrize(
    "extra, expected",
    [
        ({"classes": ["car", "Car"]}, "classes has duplicates (case-insensitive): [['car', 'Car']]"),
        ({"ignore_classes": ["CAR"]}, "names in both classes and ignore_classes: ['CAR']"),
        ({"class_mapping": {"van": "car", "Van": "car"}},
         "class_mapping has keys that differ only in case: [['van', 'Van']]"),
        ({"class_mapping": {"van": "truck"}}, "class_mapping maps to names not in classes: ['truck']"),
        ({"class_mapping": {"van": "car"}, "ignore_classes": ["VAN"]},
         "class_mapping keys also in ignore_classes: ['van']"),
    ],
)
def test_class_names_are_checked_case_insensitively(extra, expected):
    with pytest.raises(SpecError) as info:
        parse_spec({"dataset": {**MINIMAL["dataset"], **extra}})
    assert expected in str(info.value)


def test_class_mapping_target_may_differ_in_case():
    spec = parse_spec({"dataset": {**MINIMAL["dataset"], "class_mapping": {"Van": "CAR"},
                                   "ignore_classes": ["DontCare"]}})
    assert spec.dataset.class_mapping == {"Van": "CAR"}


@pytest.mark.parametrize("text, kind", [("- a\n- b\n", "list"), ("just text\n", "str")])
def test_non_mapping_spec_with_overrides(tmp_path, text, kind):
    path = tmp_path / "spec.yaml"
    path.write_text(text)
    for overrides in (None, ["train.epochs=3"]):
        with pytest.raises(SpecError, match=rf"spec\.yaml: the spec must be a YAML mapping, got {kind}"):
            load_spec(path, overrides)


def test_errors_are_one_line_per_key_naming_the_override_that_set_it(tmp_path):
    """Issue 58: an override's error names the override, not the file it was applied to; a union's members share
    one line; a list item is named by its index; an unknown key gets the nearest known one."""
    path = write(tmp_path, {**MINIMAL, **DETECTNET, "train": {"batch_size": 0}})
    with pytest.raises(SpecError) as info:
        load_spec(path, ["qat.excluded_layers=5", "engine.bench.batch_sizes=[a]", "model.decoder.methd=nms",
                         "trian.epochs=3"])
    assert str(info.value).splitlines() == [
        f"{path}: invalid spec, 5 errors:",
        "  --set model.decoder.methd=nms: model.decoder.methd: unknown key (did you mean model.decoder.method?)",
        "  train.batch_size: must be >= 1 (got 0)",
        "  --set qat.excluded_layers=5: qat.excluded_layers: must be 'auto' or a list (got 5)",
        "  --set engine.bench.batch_sizes=[a]: engine.bench.batch_sizes[0]: must be an integer (got 'a')",
        "  --set trian.epochs=3: trian: unknown key (did you mean train?)",
    ]
    assert "pydantic" not in str(info.value)


def test_format_validation_error_without_a_source():
    from pydantic import ValidationError

    from qatpipe.spec import PruneSpec, format_validation_error

    with pytest.raises(ValidationError) as info:
        PruneSpec(target_flops_ratio=2, granularity=0)
    assert format_validation_error(info.value) == (
        "invalid settings, 2 errors:\n  target_flops_ratio: must be <= 1 (got 2)\n  granularity: must be >= 1 (got 0)")
