"""The README's stage-by-stage walkthrough ("Using the stages like TAO") runs as written.

The commands are read out of README.md, so the README and this test cannot drift: each line runs, in order, in a
fresh folder, on the tiny spec instead of the default one (`-e default` -> `-e tiny`), with overrides that keep it
cheap (one epoch, a small synthetic set); a line it cannot run here is listed in NOT_RUN with the reason, and the
test fails when a README line is neither run nor listed."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from conftest import SMALL_IMAGES
from qatpipe.cli import main
from qatpipe.spec import QatSpec, bundled_spec_path, load_spec
from qatpipe.tracking.records import StageRecord

README = Path(__file__).resolve().parents[1] / "README.md"
SECTION = "## Using the stages like TAO"
# README line (a fragment of it) -> why it does not run here
NOT_RUN = {"--set ptq.tool=modelopt": "Model Optimizer runs in its own environment: test_ptq_modelopt.py"}
# what the walkthrough must show; a README that loses one of these fails the test
VERBS = {"pretrain", "train", "evaluate", "prune", "retrain", "export", "ptq", "build-engine", "bench-engine", "validate",
         "spec show", "data synth"}
FINETUNE_MAX_LR = 2.5e-4
# every `-e` command gets these: one epoch each without validation during training, 32 + 16 synthetic images
# (made once, cached in the folder) at half the tiny spec's size each way (conftest.SMALL_IMAGES); the gate is the
# spec's own (validate.max_map_drop), and its verdict is checked against the figures. Most of its time is building
# and tracing the four trainings and two exports.
CHEAP = ["train.epochs=1", "retrain.epochs=1", "train.validation_interval=0", "dataset.synthetic.train_images=32",
         "dataset.synthetic.val_images=16", *SMALL_IMAGES,
         f"qat.finetune_learning_rate={{max_lr: {FINETUNE_MAX_LR}}}",  # what --finetune trains under (checked)
         "qat.epochs=1"]  # --baseline: QAT's fine-tuning of the baseline, under qat.learning_rate (checked)
SMALL_SYNTH = ["--train", "4", "--val", "2"]  # `data synth`: a few images, not the README's 4,000
OUTPUTS = ("-o", "-r", "--out")  # what a command writes, which must exist once it ran


def readme_commands() -> list[str]:
    """The lines of the first ```bash block after SECTION."""
    text = README.read_text()
    assert SECTION in text, f"README.md has no section {SECTION!r}"
    block = re.search(r"```bash\n(.*?)```", text.split(SECTION, 1)[1], re.S)
    assert block, f"README.md: no ```bash block under {SECTION!r}"
    return [line.strip() for line in block.group(1).splitlines() if line.strip()]


def as_run_here(line: str) -> list[str]:
    """The README line as it runs here: `qatpipe ...` -> main()'s argv, on the tiny spec, cheap."""
    argv = shlex.split(line, comments=True)
    assert argv[0] == "qatpipe", line
    argv = argv[1:]
    if "-e" in argv:
        at = argv.index("-e") + 1
        assert argv[at] == "default", f"the walkthrough runs the default spec: {line}"
        argv[at] = "tiny"
        argv += [arg for override in CHEAP for arg in ("--set", override)]
    if argv[:2] == ["data", "synth"]:
        argv += SMALL_SYNTH
    return argv


def verb(argv: list[str]) -> str:
    return " ".join(argv[:2]) if argv[0] in ("spec", "data") else argv[0]


@pytest.mark.slow
def test_the_readme_walkthrough_runs_as_written(tmp_path, monkeypatch, capsys):
    lines = readme_commands()
    for fragment in NOT_RUN:  # each exception still names one README line
        assert sum(fragment in line for line in lines) == 1, f"NOT_RUN {fragment!r}: not one README line"
    monkeypatch.chdir(tmp_path)  # the README's relative results/ and data/, and the spec's .qatpipe-cache
    ran = []
    for line in lines:
        if any(fragment in line for fragment in NOT_RUN):
            continue
        argv = as_run_here(line)
        capsys.readouterr()
        code = main(argv)
        # validate exits 1 when the engine misses the gate (README): its verdict is checked on the figures below
        assert code == 0 or (verb(argv) == "validate" and code == 1), \
            f"README command failed: {line}\n(ran as: qatpipe {shlex.join(argv)})"
        for flag in OUTPUTS:
            if flag in argv:
                written = Path(argv[argv.index(flag) + 1])
                assert written.exists(), f"{line}: wrote no {written}"
        ran.append((verb(argv), argv, capsys.readouterr().out, code))
    assert {name for name, _, _, _ in ran} == VERBS
    assert len(ran) == len(lines) - len(NOT_RUN)

    # what the steps left behind is what the next ones read
    assert Path("results/train/evaluate/metrics.json").is_file()  # evaluate's default folder: beside the model
    assert Path("results/pruned/prune_report.json").is_file()
    for results in ("train", "retrain", "qat"):
        assert Path(f"results/{results}/model.keras").is_file(), results
    # --baseline: the default spec's plan (qat.start baseline, qat.finetune_epochs 0): QAT fine-tunes the FP32
    # retrain's model, under qat.learning_rate
    assert StageRecord.read(Path("results/qat")).stage == "retrain_qat"
    assert load_spec("results/qat/spec.yaml").train.learning_rate.max_lr == QatSpec().learning_rate.max_lr
    assert Path(json.loads(Path("results/qat/source_model.json").read_text())["path"]).resolve() == Path(
        "results/retrain/model.keras").resolve()
    assert load_spec("results/retrain/spec.yaml").train.learning_rate.max_lr != FINETUNE_MAX_LR  # train's
    # the full spec's second FP32 training, as the README's note gives it (on tiny, cheap): --finetune trains the
    # FP32 baseline under qat.finetune_learning_rate
    finetune = ["retrain", "-e", "tiny", "-m", "results/retrain/model.keras", "-r", "results/fp32", "--finetune",
                *[arg for override in CHEAP for arg in ("--set", override)]]
    assert main(finetune) == 0
    assert StageRecord.read(Path("results/fp32")).stage == "finetune_fp32"
    assert load_spec("results/fp32/spec.yaml").train.learning_rate.max_lr == FINETUNE_MAX_LR
    assert {"qat.onnx", "qat.cache", "qat_implicit.onnx", "fp32.onnx", "ptq.onnx"} <= {
        path.name for path in Path("results").iterdir()}
    assert json.loads(Path("results/engine_qat/bench.json").read_text())["batches"]
    _check_the_gate(next(code for name, _, _, code in ran if name == "validate"))
    [spec_show] = [out for name, _, out, _ in ran if name == "spec show"]
    assert "epochs: 1" in spec_show and "backbone:" in spec_show
    synthesized = [argv[argv.index("--out") + 1] for name, argv, _, _ in ran if name == "data synth"]
    assert synthesized, "the walkthrough makes no data set"
    for folder in synthesized:  # each README `data synth` made SMALL_SYNTH's four training images
        assert len(list(Path(folder, "train", "images").iterdir())) == 4, folder


def _check_the_gate(code: int) -> None:
    """The README's validate ran under the spec's own gate: its verdict and exit code are what the recorded figures
    and that budget make them; then the same engine against a baseline that gives the other verdict (one epoch's
    figures are near zero, so the README's run alone would show only a pass)."""
    max_drop = load_spec(bundled_spec_path("tiny")).validate_.max_map_drop
    validation = json.loads(Path("results/engine_qat/validate/validation.json").read_text())
    baseline = json.loads(Path("results/eval_fp32/metrics.json").read_text())["map50"]
    assert validation["variant"] == "qat" and validation["max_map_drop"] == max_drop <= 0.02  # not loosened
    assert validation["baseline_map50"] == pytest.approx(baseline)
    maps = [validation[key] for key in ("map50", "map50_tensorrt_emulated") if key in validation]
    drops = [validation[f"{key}_drop"] for key in ("map50", "map50_tensorrt_emulated") if key in validation]
    assert drops == pytest.approx([baseline - value for value in maps], abs=1e-6)
    passed = all(drop <= max_drop for drop in drops)
    assert validation["passed"] is passed and code == (0 if passed else 1)
    assert Path("results/engine_qat/validate/deepstream").is_dir() == passed  # a passing model's hand-off only
    # the other verdict: a baseline max_drop above the best figure fails, one max_drop / 2 above the worst passes
    other = max(maps) + 2 * max_drop if passed else min(maps) + max_drop / 2
    Path("results/other_baseline.json").write_text(json.dumps({"map50": other, "map": 0.0}))
    argv = ["validate", "-e", "tiny", "-m", "results/engine_qat", "--baseline", "results/other_baseline.json",
            "-o", "results/validate_other", "--variant", "qat", *[a for o in CHEAP for a in ("--set", o)]]
    assert main(argv) == (1 if passed else 0)
    again = json.loads(Path("results/validate_other/validation.json").read_text())
    assert again["passed"] is not passed and again["map50"] == validation["map50"]
