"""Benchmark: the QAT fine-tuning recipe (`qat.start: fp32`), its epochs and learning rate, against a run's own.

    python bench/finetune.py --run RUN [--work DIR] --recipe NAME KEY=VALUE ... [--recipe ...]

RUN is a finished `qatpipe run --local` folder whose QAT fine-tuned the FP32 retrain's model or the FP32 baseline
(`qat.start` fp32 or baseline). Each recipe (its `qat.*` overrides, e.g. `qat.finetune_epochs=4` and a whole
`qat.finetune_learning_rate={...}`) fine-tunes that same FP32 retrain's model in FP32 (the baseline) and makes its
QAT model through the pipeline's own plan (stages/retrain_plan.py): fine-tuning that FP32 retrain's model too
(start fp32) or the baseline just trained (start baseline). It exports both to ONNX and evaluates them on the
run's val set, as the run's evaluate tasks scored its own two. Prints per recipe and for the run's own: FP32 and
QAT mAP@0.5 with 95% bootstrap CIs, QAT - FP32 paired, each against the run's own FP32 (paired over the val
images; the spread between training runs is not in the CIs) and the seconds each fine-tuning trained (its
train_summary.json). Writes WORK/bench_finetune.json.
"""

import argparse
import json
import logging
from pathlib import Path

import yaml

from runs import ci_text, read_json  # bench/runs.py, beside this script

from qatpipe_pipelines.run_folder import RunFolder

log = logging.getLogger("bench")

RUN = "run"  # the run's own fine-tunings, the recipe the others are measured against


def finetune(run: Path, folder: Path, overrides: list[str]) -> None:
    """The run's FP32 retrain's model fine-tuned with QAT and in FP32 under the run's fine-tuning spec with
    `overrides`, exported and evaluated into `folder`/{qat,fp32}; what an earlier call finished is kept."""
    from qatpipe.spec import apply_overrides, parse_spec
    from qatpipe.stages.evaluate import evaluate
    from qatpipe.stages.export import export
    from qatpipe.stages.retrain import retrain
    from qatpipe.stages.retrain_plan import plan_retrain

    fp32_retrain = RunFolder(run).stage("retrain_fp32") / "model.keras"
    spec_file = RunFolder(run).stage("finetune_fp32") / "spec.yaml"  # QAT's sections as the QAT retrain had them
    base = parse_spec(apply_overrides(yaml.safe_load(spec_file.read_text()), overrides), str(spec_file))
    for variant in ("fp32", "qat"):
        out = folder / variant
        if (out / "evaluation" / "metrics.json").is_file():
            continue
        spec = base.model_copy(deep=True)
        spec.qat.enabled = variant == "qat"
        # under qat.start baseline QAT fine-tunes the FP32 baseline trained just before it
        plan = plan_retrain(spec, spec.qat.enabled, fp32_retrain, fp32_retrain,
                            folder / "fp32" / "retrain" / "model.keras")
        summary = retrain(plan.applied(spec), plan.source, out / "retrain", stage_name=plan.stage_name)
        export(spec, summary["model"], out / "model.onnx")
        evaluate(spec, out / "model.onnx", out / "evaluation")


def describe(run: Path, work: Path, recipes: dict[str, list[str]]) -> dict:
    from qatpipe.stages.compare import uncertainty

    # the run's QAT model as its validation scored it (the pipeline scores an INT8 model once, there)
    folder = RunFolder(run)
    evaluations = {f"{RUN}/fp32": folder.stage("evaluate_fp32"), f"{RUN}/qat": folder.stage("validate_qat")}
    for name in recipes:
        evaluations.update({f"{name}/{v}": work / name / v / "evaluation" for v in ("fp32", "qat")})
    names = [RUN, *recipes]
    pairs = [(f"{n}/qat", f"{n}/fp32") for n in names] + [(f"{n}/{v}", f"{RUN}/fp32") for n in names[1:]
                                                          for v in ("fp32", "qat")]
    scored = uncertainty(evaluations, pairs=pairs)
    rows = {}
    for name in names:
        trained = {v: read_json((folder.stage("finetune_fp32" if v == "fp32" else "retrain_qat") if name == RUN
                                 else work / name / v / "retrain") / "train_summary.json") for v in ("fp32", "qat")}
        rows[name] = {
            "overrides": recipes.get(name, []),
            "epochs": trained["fp32"].get("epochs"),
            **{f"{v}_map50": scored["variants"][f"{name}/{v}"]["map50"] for v in ("fp32", "qat")},
            "qat_minus_fp32": scored["pairs"][f"{name}/qat-{name}/fp32"]["map50"],
            **({f"{v}_minus_run_fp32": scored["pairs"][f"{name}/{v}-{RUN}/fp32"]["map50"] for v in ("fp32", "qat")}
               if name != RUN else {}),
            "seconds": {v: summary.get("wall_seconds") for v, summary in trained.items()},  # the training's own
        }
    return {"run": str(run), "val_images": scored["images"], "recipes": rows}


def _pair(pair: dict | None) -> str:
    return f"{100 * pair['diff']:+6.2f} {ci_text(pair['ci95'], 100, '+')}" if pair else ""


def print_report(result: dict) -> None:
    print(f"\nfine-tuning recipes from {result['run']}'s FP32 retrain, {result['val_images']} val images")
    print(f"{'recipe':<14} {'epochs':>6}  {'FP32 mAP@0.5':<26} {'QAT mAP@0.5':<26} {'QAT - FP32 (points)':<24} "
          f"{'FP32 - run FP32':<24} {'QAT - run FP32':<24} seconds FP32 / QAT")
    for name, row in result["recipes"].items():
        cells = [f"{row[f'{v}_map50']['value']:.4f} {ci_text(row[f'{v}_map50'].get('ci95'))}" for v in ("fp32", "qat")]
        secs = row["seconds"]
        print(f"{name:<14} {row['epochs'] or '':>6}  {cells[0]:<26} {cells[1]:<26} {_pair(row['qat_minus_fp32']):<24} "
              f"{_pair(row.get('fp32_minus_run_fp32')):<24} {_pair(row.get('qat_minus_run_fp32')):<24} "
              f"{secs.get('fp32')} / {secs.get('qat')}")
        if row["overrides"]:
            print(f"{'':<14} {' '.join(row['overrides'])}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", type=Path, required=True)
    parser.add_argument("--work", type=Path, default=Path("results/bench_finetune"))
    parser.add_argument("--recipe", nargs="+", action="append", default=[], metavar=("NAME", "KEY=VALUE"),
                        help="a recipe's name and its qat.* overrides")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    recipes = {name: sets for name, *sets in args.recipe}
    if RUN in recipes:
        parser.error(f"{RUN!r} names the run's own fine-tunings")
    for name, sets in recipes.items():
        finetune(args.run, args.work / name, sets)
    result = describe(args.run, args.work, recipes)
    (args.work / "bench_finetune.json").write_text(json.dumps(result, indent=2))
    print_report(result)


if __name__ == "__main__":
    main()
