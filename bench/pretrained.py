"""Benchmark: the whole pipeline from scratch and from a backbone pretrained by `qatpipe pretrain` (issue 36).

    python bench/pretrained.py [--work DIR] [--backbones NAME ...] [--kind glyphs_shift] [--set KEY=VALUE ...]
                               [--pretrain-images N] [--no-half]

1. Pretraining data: the `shapes` and `photos` synthetic sets (train splits, N images each), written to
   WORK/pretrain_data; for each backbone, `qatpipe pretrain` on their object and background crops (the default
   spec's pretrain section, `pretrain.data` set to both), timed; its held-back top-1 against chance.
2. For each backbone, three runs of `qatpipe run --local` on the full spec with the data set `--kind`
   (default glyphs_shift: the glyphs set whose val split is printed in fonts train never shows), only the
   backbone and the `--set` overrides changed: from scratch; from the pretrained weights
   (`model.pretrained`); and from them at half the epochs (`train.epochs` halved; the retrains and fine-tunings
   keep `retrain.epochs`, which the full spec sets to 8).
3. Prints per run: FP32 / PTQ / QAT mAP@0.5 with their 95% bootstrap CIs, the paired difference of each
   pretrained run's FP32 mAP@0.5 from the scratch run's (same val images: paired bootstrap, 1,000 resamples),
   the unpruned model's mAP@0.5, train's time and the run's wall time. With `--kind glyphs_shift` it also scores
   every run's FP32 model on the glyphs set's own val split (fonts seen in training), with the paired
   differences, so one training answers both questions.
`--train-only` runs train and evaluate (library stages, the unpruned FP32 model) instead of the whole pipeline:
the pretrained start's FP32 question at about a third of the time; no PTQ / QAT figures then.
`--own` adds a fourth run: the pipeline's own pretrained start (`model.pretrained: pipeline:pretrain`, the
backbone pretrained on the run's training crops) at half the epochs, the candidate for a shorter main job;
`--freeze-blocks N ...` with it a fifth, the same with those blocks frozen (`model.freeze_blocks`, TAO's
`freeze_blocks`); `--scratch-half` the control, from scratch at half the epochs (what the start adds there).
`--skip pretrained pretrained_half` leaves out the shapes+photos start (scratch, the reference, always runs).
Writes WORK/bench_pretrained.json.

Targets (issue 36): the style-shift val gains >= 5 points FP32 mAP@0.5 with a CI excluding 0; half the epochs
from the pretrained start reach the scratch run's mAP@0.5 within its CI.
"""

import argparse
import json
import logging
import time
from pathlib import Path

from paired import paired_difference  # bench/paired.py, beside this script
from recipe import collect  # bench/recipe.py
from runs import ci_text, evaluation_folders, num_text, synthetic_classes  # bench/runs.py, beside this script

log = logging.getLogger("bench")


def pretrain_data(work: Path, images: int) -> list[str]:
    from qatpipe.data.synth import write_synthetic_dataset

    folders = []
    for kind in ("shapes", "photos"):
        out = work / "pretrain_data" / kind
        if not (out / "train").is_dir():
            write_synthetic_dataset(out, num_train=images, num_val=1, seed=7, kind=kind)
        folders.append(str(out / "train"))
    return folders


def pretrain_backbone(backbone: str, work: Path, data: list[str], tag: str = "") -> dict:
    from qatpipe.spec import bundled_spec_path, load_spec
    from qatpipe.stages.pretrain import SUMMARY_FILE, WEIGHTS_FILE, pretrain

    out = work / f"pretrain_{backbone}{tag}"
    if not (out / WEIGHTS_FILE).is_file():
        spec = load_spec(bundled_spec_path("full"), [f"model.backbone.name={backbone}",
                                                        f"pretrain.data=[{', '.join(data)}]"])
        started = time.perf_counter()
        pretrain(spec, out)
        log.info("pretrain %s: %.0f s", backbone, time.perf_counter() - started)
    return {"weights": str(out / WEIGHTS_FILE), **json.loads((out / SUMMARY_FILE).read_text())}


def synthetic_folder(work: Path, sets: list[str]) -> Path:
    """The spec's synthetic set, written once beside the runs (as the pipeline's prepare-data writes it)."""
    from qatpipe.data.synth import write_synthetic_dataset
    from qatpipe.spec import bundled_spec_path, load_spec

    synthetic = load_spec(bundled_spec_path("full"), sets).dataset.synthetic
    data = work / f"data_{synthetic.kind}_{synthetic.train_images}_{synthetic.val_images}_{synthetic.seed}"
    if not (data / "val").is_dir():
        write_synthetic_dataset(data, num_train=synthetic.train_images, num_val=synthetic.val_images,
                                seed=synthetic.seed, kind=synthetic.kind)
    return data


def map50_ci(evaluation: Path) -> list[float]:
    """An evaluation's mAP@0.5 95% CI, bootstrapped over its val images as compare does (1,000 resamples)."""
    from qatpipe.metrics.bootstrap import match_detections, paired_bootstrap
    from qatpipe.stages.evaluate import DETECTIONS_FILE, GROUND_TRUTH_FILE

    matched = match_detections(json.loads((evaluation / GROUND_TRUTH_FILE).read_text()),
                               json.loads((evaluation / DETECTIONS_FILE).read_text()))
    return paired_bootstrap({"x": matched}, [])["variants"]["x"]["map50"]["ci95"]


def train_and_evaluate(name: str, work: Path, sets: list[str]) -> dict:
    """--train-only: train's library stage on the full spec with `sets`, then evaluate's on the trained
    (unpruned) model; the FP32 question without the pruning, retrains and quantization of a whole run."""
    from qatpipe.spec import bundled_spec_path, load_spec
    from qatpipe.stages.evaluate import evaluate
    from qatpipe.stages.train import train

    out = work / name
    spec = load_spec(bundled_spec_path("full"), sets)
    if spec.dataset.train is None:
        data = synthetic_folder(work, sets)
        spec = load_spec(bundled_spec_path("full"), [*sets, f"dataset.train={data / 'train'}",
                                                        f"dataset.val={data / 'val'}"])
    if not (out / "evaluation" / "metrics.json").is_file():
        train(spec, out / "train")
        evaluate(spec, out / "train" / "model.keras", out / "evaluation", stage_name="evaluate_unpruned",
                 variant="unpruned")
    metrics = json.loads((out / "evaluation" / "metrics.json").read_text())
    summary = json.loads((out / "train" / "train_summary.json").read_text())
    return {"overrides": sets, "variants": {"fp32": {"map50": metrics["map50"],
                                                     "map50_ci95": map50_ci(out / "evaluation")}},
        "unpruned_map50": metrics["map50"], "train_seconds": summary.get("wall_seconds"),
        "best_epoch": summary.get("best_epoch"), "epochs": summary.get("epochs"),
        "wall_seconds": summary.get("wall_seconds"), "evaluation": str(out / "evaluation"),
        "model": str(out / "train" / "model.keras")}


def run_pipeline(name: str, work: Path, sets: list[str]) -> dict:
    from qatpipe_pipelines.local_run import run_local
    from qatpipe_pipelines.run_folder import RunFolder

    started = time.perf_counter()
    if not (work / name / "summary.json").is_file():
        run_local(work / name, "full", sets)
    row = collect(name, work, sets, time.perf_counter() - started)
    train = json.loads((RunFolder(work / name).stage("train") / "train_summary.json").read_text())
    row["train_seconds"] = train.get("wall_seconds")
    row["evaluation"] = str(evaluation_folders(work / name)["fp32"])
    row["model"] = json.loads((Path(row["evaluation"]) / "metrics.json").read_text())["model"]
    return row


def score_on(model: str, val: Path, kind: str, out: Path) -> Path:
    """A run's FP32 model scored on another val split (evaluate's library stage); its results folder."""
    from qatpipe.spec import bundled_spec_path, load_spec
    from qatpipe.stages.evaluate import evaluate

    if not (out / "metrics.json").is_file():
        spec = load_spec(bundled_spec_path("full"), [f"dataset.synthetic.kind={kind}",
                                                        f"dataset.classes={synthetic_classes(kind)}",
                                                        f"dataset.train={val}", f"dataset.val={val}"])
        evaluate(spec, Path(model), out, stage_name="evaluate_fp32", variant="fp32")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path("results/bench_pretrained"))
    parser.add_argument("--backbones", nargs="+", default=["resnet"])
    parser.add_argument("--kind", default="glyphs_shift")
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--pretrain-images", type=int, default=1000, help="train images of each pretraining set")
    parser.add_argument("--no-half", action="store_true", help="skip the half-epochs run")
    parser.add_argument("--own", action="store_true",
                        help="also the pipeline's own pretrained start (pipeline:pretrain: the run's training crops) "
                             "at half the epochs")
    parser.add_argument("--freeze-blocks", type=int, nargs="+", default=[],
                        help="with --own: also its run with these backbone blocks frozen (model.freeze_blocks)")
    parser.add_argument("--scratch-half", action="store_true",
                        help="also from scratch at half the epochs: what a pretrained start adds at half the epochs")
    parser.add_argument("--skip", nargs="+", default=[], choices=("pretrained", "pretrained_half"),
                        help="leave out these runs of the shapes+photos start")
    parser.add_argument("--train-only", action="store_true",
                        help="train and evaluate the unpruned FP32 model only, not the whole pipeline")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from qatpipe.spec import bundled_spec_path, load_spec

    work = args.work
    half_epochs = f"train.epochs={max(1, load_spec(bundled_spec_path('default'), args.sets).train.epochs // 2)}"
    # the shapes+photos start, where a run of it is left: pretrained, or pretrained_half unless --no-half
    wanted = {"pretrained", *([] if args.no_half else ["pretrained_half"])} - set(args.skip)
    data = pretrain_data(work, args.pretrain_images) if wanted else None
    rows = []
    for backbone in args.backbones:
        pretrained = pretrain_backbone(backbone, work, data) if wanted else None
        base = [f"dataset.synthetic.kind={args.kind}", f"dataset.classes={synthetic_classes(args.kind)}",
                f"model.backbone.name={backbone}", *args.sets]
        result = {"backbone": backbone, "pretrain": pretrained, "runs": {}}
        runs = {"scratch": base}
        if args.scratch_half:
            runs["scratch_half"] = [*base, half_epochs]
        if pretrained:
            full = [*base, f"model.pretrained={pretrained['weights']}"]
            runs.update({name: sets for name, sets in (("pretrained", full), ("pretrained_half", [*full, half_epochs]))
                         if name in wanted})
        if args.own:  # the pipeline's own pretrain stage (pipeline:pretrain): the run's training crops, half epochs
            if args.train_only:
                own = pretrain_backbone(backbone, work, [str(synthetic_folder(work, base) / "train")], "_own")
                result["pretrain_own"] = own
                start = f"model.pretrained={own['weights']}"
            else:
                start = "model.pretrained=pipeline:pretrain"
            runs["own_half"] = [*base, start, half_epochs]
            if args.freeze_blocks:
                runs["own_half_frozen"] = [*runs["own_half"], f"model.freeze_blocks={args.freeze_blocks}"]
        runner = train_and_evaluate if args.train_only else run_pipeline
        for name, sets in runs.items():
            result["runs"][name] = runner(f"{backbone}_{name}", work, sets)
        scratch_eval = Path(result["runs"]["scratch"]["evaluation"])
        for name in runs:
            if name != "scratch":
                result["runs"][name]["fp32_vs_scratch"] = paired_difference(
                    scratch_eval, Path(result["runs"][name]["evaluation"]), ("scratch", name))
        if args.kind == "glyphs_shift":  # the same models on the fonts training saw
            seen = work / "glyphs_val"
            if not (seen / "val").is_dir():
                from qatpipe.data.synth import write_synthetic_dataset

                spec = load_spec(bundled_spec_path("full"), args.sets)
                write_synthetic_dataset(seen, num_train=1, num_val=spec.dataset.synthetic.val_images,
                                        seed=spec.dataset.synthetic.seed, kind="glyphs")
            folders = {name: score_on(result["runs"][name]["model"], seen / "val", "glyphs",
                                      work / f"{backbone}_{name}_on_glyphs") for name in runs}
            result["seen_fonts"] = {name: json.loads((folder / "metrics.json").read_text())["map50"]
                                    for name, folder in folders.items()}
            result["seen_fonts_vs_scratch"] = {
                name: paired_difference(folders["scratch"], folder, ("scratch", name))
                for name, folder in folders.items() if name != "scratch"}
        rows.append(result)
        (work / "bench_pretrained.json").write_text(json.dumps(rows, indent=2) + "\n")
    report(rows)


def _diff(d: dict) -> str:
    return f"{100 * d['diff']:+.2f} [{100 * d['ci95'][0]:+.2f}, {100 * d['ci95'][1]:+.2f}]"


def report(rows: list[dict]) -> None:
    for row in rows:
        for key in ("pretrain", "pretrain_own"):
            if row.get(key):  # None where --skip left the shapes+photos start out
                p = row[key]
                print(f"\n{row['backbone']} {key}: top-1 {num_text(p.get('top1'), '{:.3f}')} on {p.get('val_crops')} "
                      f"held-back crops, {p.get('num_classes')} classes "
                      f"(chance {num_text(p.get('chance'), '{:.3f}')}), "
                      f"{num_text(p.get('wall_seconds'), '{:.0f}')} s")
        print("run              variant  mAP@0.5  95% CI")
        for name, run in row["runs"].items():
            for variant, v in run["variants"].items():
                print(f"{name:<16} {variant:<8} {v['map50']:.4f}   {ci_text(v['map50_ci95'])}")
        print("run              FP32 - scratch (points, paired 95% CI)   unpruned mAP@0.5  train s  wall s")
        for name, run in row["runs"].items():
            diff = _diff(run["fp32_vs_scratch"]["map50"]) if "fp32_vs_scratch" in run else "-"
            print(f"{name:<16} {diff:<40} {num_text(run['unpruned_map50'])}            "
                  f"{num_text(run.get('train_seconds'), '{:.0f}')}    {num_text(run['wall_seconds'], '{:.0f}')}")
        if "seen_fonts" in row:
            print("on the glyphs val split (fonts seen in training): FP32 mAP@0.5, and - scratch (paired)")
            for name, value in row["seen_fonts"].items():
                diff = _diff(row["seen_fonts_vs_scratch"][name]["map50"]) if name != "scratch" else "-"
                print(f"{name:<16} {value:.4f}   {diff}")


if __name__ == "__main__":
    main()
