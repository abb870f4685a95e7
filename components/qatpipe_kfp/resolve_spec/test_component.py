import yaml

from qatpipe_kfp.resolve_spec.component import resolve_spec


def test_each_stage_gets_only_its_sections():
    """The outputs, their sections and their descriptions all follow STAGE_SECTIONS, the one table."""
    from qatpipe.spec import STAGE_SECTIONS, spec_output_name

    out = resolve_spec.python_func(spec_uri="tiny", overrides=["train.epochs=3"])
    assert yaml.safe_load(out.spec)["train"]["epochs"] == 3
    assert list(resolve_spec.component_spec.outputs) == ["spec", *map(spec_output_name, STAGE_SECTIONS),
                                                         "registry_name"]
    for view, sections in STAGE_SECTIONS.items():
        # a view without the model section still names the arch (its image size is checked against it)
        expected = list(sections) if "model" in sections else [*sections, "model"]
        assert list(yaml.safe_load(getattr(out, spec_output_name(view)))) == expected, view
        described = " ".join(resolve_spec.component_spec.outputs[spec_output_name(view)].description.split())
        named = described[described.index("(section") + 1:described.index(")")].split(";")[0].split(" ", 1)[1]
        named = named.split(", ")  # ... then, after a ';', what a setting adds (spec.SETTING_SECTIONS)
        assert named == list(sections), (view, described)
    # what the table says, spelt out: training never sees the gate or export settings, validate no training
    # the data view: its sections, and the arch alone, so its image size is checked against the run's arch
    data_view = yaml.safe_load(out.data_spec)
    assert set(data_view) == {"dataset", "model"} and set(data_view["model"]) == {"arch"}
    assert set(yaml.safe_load(out.train_spec)) == {"dataset", "model", "augmentation", "train", "evaluate"}
    assert set(yaml.safe_load(out.evaluate_spec)) == {"dataset", "model", "evaluate"}
    assert set(yaml.safe_load(out.prune_spec)) == {"dataset", "model", "prune"}
    assert set(yaml.safe_load(out.retrain_spec)) == {"dataset", "model", "augmentation", "train", "evaluate",
                                                     "retrain"}
    assert set(yaml.safe_load(out.retrain_qat_spec)) == {"dataset", "model", "augmentation", "train", "evaluate",
                                                         "retrain", "qat"}
    assert set(yaml.safe_load(out.export_spec)) == {"dataset", "model", "export"}
    assert set(yaml.safe_load(out.ptq_spec)) == {"dataset", "model", "evaluate", "ptq"}
    assert set(yaml.safe_load(out.engine_spec)) == {"dataset", "model", "engine"}
    assert set(yaml.safe_load(out.validate_spec)) == {"dataset", "model", "evaluate", "engine", "validate"}
    assert out.registry_name == "qatpipe-detectnet-v2"


def test_unrelated_change_keeps_the_training_input_identical():
    # KFP caches on inputs: editing the validation gate must not retrain
    base = resolve_spec.python_func(spec_uri="tiny", overrides=[])
    gated = resolve_spec.python_func(spec_uri="tiny", overrides=["validate.max_map_drop=0.02"])
    assert gated.train_spec == base.train_spec and gated.spec != base.spec
    # nor does a QAT setting touch the FP32 retrain
    qat = resolve_spec.python_func(spec_uri="tiny", overrides=["qat.relu6=true"])
    assert qat.retrain_spec == base.retrain_spec and qat.retrain_qat_spec != base.retrain_qat_spec
    # under qat.excluded_layers auto the QAT retrain reads the budget, ptq and sensitivity sections too (its
    # search); its FP32 control does not, so a new budget re-runs the QAT retrain and the control stays cached
    auto = resolve_spec.python_func(spec_uri="tiny", overrides=["qat.excluded_layers=auto"])
    budget = resolve_spec.python_func(spec_uri="tiny", overrides=["qat.excluded_layers=auto",
                                                                  "validate.max_map_drop=0.02"])
    assert {"export", "ptq", "sensitivity", "validate"} <= set(yaml.safe_load(auto.retrain_qat_spec))
    assert budget.retrain_qat_spec != auto.retrain_qat_spec and budget.finetune_fp32_spec == auto.finetune_fp32_spec
    assert "validate" not in yaml.safe_load(auto.finetune_fp32_spec)
    assert gated.retrain_qat_spec == base.retrain_qat_spec  # without auto the budget reaches no training


def test_s3_data_without_keys_fails_first_naming_the_key(monkeypatch):
    """Outside a pod the environment is what the check reads (tests/test_credentials.py plays the API)."""
    import pytest

    from qatpipe.cluster.credentials import CredentialsError

    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_WEB_IDENTITY_TOKEN_FILE"):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(CredentialsError, match="AWS_ACCESS_KEY_ID is not set, and the spec reads s3://b/train"):
        resolve_spec.python_func(spec_uri="tiny", overrides=["dataset.train=s3://b/train", "dataset.val=s3://b/val"],
                                 credentials_secret="qatpipe-credentials")

