"""Benchmark: mixed precision on this machine: training throughput, and what it does to mAP.

    python bench/amp.py [--work DIR] [--train-images 480] [--repeats 2] [--set KEY=VALUE ...]
                        [--runs FP32_RUN AMP_RUN]

Throughput: the full spec's detector trained by the real `train` stage (data pipeline included, validation
off) for two epochs on the default synthetic data, once per policy and repeat, float32 and `train.use_amp`
alternating; the figure is the second epoch's images/s (the first carries tf.function tracing). `--set` changes
the spec as the CLI's does (e.g. `model.arch=detectnet_v2`, `model.backbone.name=mobilenet_v2`). It prints the
policy `train.use_amp` picked here and why (training/precision.py), the images/s per run, and the median ratio.

mAP (`--runs`): two finished `qatpipe run --local` folders of the same spec and data, the first trained in
float32 and the second with `train.use_amp=true` (e.g. `bench/recipe.py --kinds shapes --set
train.use_amp=false` and `... =true`). For the unpruned model and the retrained FP32 model it prints each
run's mAP@0.5 and the paired difference AMP - float32 with its 95% bootstrap CI over the val images.

Targets (issue "Speed where the work is"): AMP training at least 2.5x float32's throughput on this CPU; the
full spec turns AMP on if FP32 mAP@0.5 stays within 0.5 points. Writes WORK/bench_amp.json.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
from pathlib import Path

import qatpipe  # noqa: F401 - sets TF_USE_LEGACY_KERAS
from qatpipe.spec import bundled_spec_path, load_spec

log = logging.getLogger("bench")


def throughput(work: Path, train_images: int, repeats: int, sets: list[str]) -> dict:
    from qatpipe.data.synth import write_synthetic_dataset
    from qatpipe.stages.train import train
    from qatpipe.training.precision import configure_precision

    spec = load_spec(bundled_spec_path("full"), sets)
    data = work / "data"
    if not (data / "train").is_dir():
        write_synthetic_dataset(data, num_train=train_images, num_val=16)
    spec.dataset.train, spec.dataset.val = str(data / "train"), str(data / "val")
    spec.train.epochs, spec.train.validation_interval, spec.train.checkpoint_interval = 2, 0, 2
    chosen = configure_precision(True)
    runs = []
    for repeat in range(repeats):
        for use_amp in (False, True):
            folder = work / f"train_{'amp' if use_amp else 'fp32'}_{repeat}"
            if folder.exists():
                raise SystemExit(f"{folder} exists: a timing run needs a fresh folder (this script never deletes)")
            summary = train(spec, folder, use_amp=use_amp)
            images = summary["steps_per_epoch"] * spec.train.batch_size
            runs.append({"policy": summary["precision"], "use_amp": use_amp,
                         "images_per_second": round(images / summary["epoch_seconds"][-1], 1)})
            log.info("%s: %.1f img/s (second epoch)", runs[-1]["policy"], runs[-1]["images_per_second"])
    fp32 = statistics.median(r["images_per_second"] for r in runs if not r["use_amp"])
    amp = statistics.median(r["images_per_second"] for r in runs if r["use_amp"])
    return {"amp_policy_here": chosen.policy, "why": chosen.reason, "overrides": sets,
            "arch": spec.model.arch, "backbone": spec.model.backbone.name, "batch_size": spec.train.batch_size,
            "image_size": [spec.dataset.image_size.height, spec.dataset.image_size.width], "runs": runs,
            "fp32_images_per_second": fp32, "amp_images_per_second": amp, "speedup": round(amp / fp32, 2)}


def _evaluation_folders(run: Path) -> dict[str, Path]:
    """The unpruned model's and the retrained FP32 model's evaluation folders of a `qatpipe run --local` folder."""
    from runs import evaluation_folders  # bench/runs.py, beside this script

    found = evaluation_folders(run)
    missing = {"unpruned", "fp32"} - set(found)
    if missing:
        raise SystemExit(f"{run}: no evaluation of the {', '.join(sorted(missing))} model found")
    return found


def map_difference(fp32_run: Path, amp_run: Path) -> dict:
    from paired import paired_difference  # bench/paired.py, beside this script

    folders = {"float32": _evaluation_folders(fp32_run), "amp": _evaluation_folders(amp_run)}
    results = {}
    for model in ("unpruned", "fp32"):
        pair = paired_difference(folders["float32"][model], folders["amp"][model], ("float32", "amp"))
        results[model] = {"float32_map50": pair["map50"]["float32"], "amp_map50": pair["map50"]["amp"],
                          "diff": pair["map50"]["diff"], "ci95": pair["map50"]["ci95"], "images": pair["images"]}
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path("results/bench_amp"))
    parser.add_argument("--train-images", type=int, default=480)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                        help="a spec override for the throughput runs, as the CLI's --set")
    parser.add_argument("--runs", type=Path, nargs=2, metavar=("FP32_RUN", "AMP_RUN"),
                        help="also compare the mAP of two finished pipeline runs")
    parser.add_argument("--skip-throughput", action="store_true")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    args.work.mkdir(parents=True, exist_ok=True)
    report = {"machine": f"{os.cpu_count()} CPU cores, {platform.machine()}, Python {platform.python_version()}"}
    if not args.skip_throughput:
        report["throughput"] = throughput(args.work, args.train_images, args.repeats, args.sets)
    if args.runs:
        report["map50"] = map_difference(*args.runs)
        report["runs"] = [str(run) for run in args.runs]
    (args.work / "bench_amp.json").write_text(json.dumps(report, indent=2) + "\n")

    print(f"\n{report['machine']}")
    if "throughput" in report:
        t = report["throughput"]
        print(f"train.use_amp here: {t['amp_policy_here']} ({t['why']})")
        print(f"training {t['arch']} on {t['backbone']}, batch {t['batch_size']}, "
              f"{t['image_size'][0]}x{t['image_size'][1]}, second epoch:")
        for run in t["runs"]:
            print(f"  {run['policy']:<15} {run['images_per_second']:7.1f} img/s")
        print(f"median: float32 {t['fp32_images_per_second']:.1f}, AMP {t['amp_images_per_second']:.1f} img/s: "
              f"{t['speedup']:.2f}x (target 2.5x)")
    if "map50" in report:
        print("\nmAP@0.5, float32 run vs AMP run (paired bootstrap over the val images, 1000 resamples):")
        print("model     float32  AMP     AMP - float32 (points)  95% CI (points)")
        for model, r in report["map50"].items():
            print(f"{model:<9} {r['float32_map50']:.4f}   {r['amp_map50']:.4f}  {100 * r['diff']:+7.2f}"
                  f"                [{100 * r['ci95'][0]:+.2f}, {100 * r['ci95'][1]:+.2f}]")
    print(f"\nfigures: {args.work / 'bench_amp.json'}")


if __name__ == "__main__":
    main()
