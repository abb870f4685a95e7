"""Benchmark: does the default recipe learn data it was not tuned on? The whole pipeline per data set.

    python bench/recipe.py [--work DIR] [--kinds shapes glyphs photos] [--set KEY=VALUE ...]

For each generated data set (`dataset.synthetic.kind`: the default `shapes`, and `glyphs` and `photos`,
whose ten classes differ only in internal detail; data/synth/detail.py) it runs `qatpipe run --local` on the
full spec with only the data set and its classes changed, and prints per data set: FP32 / PTQ / QAT
mAP@0.5 with their 95% bootstrap CIs, the paired differences, the FP32 model's class-agnostic mAP@0.5 and
class accuracy at found objects (the learning check), the unpruned model's mAP@0.5 and the epoch of its best
val mAP@0.5, and the wall time. Writes WORK/bench_recipe.json.
"""

import argparse
import json
import logging
import os
import time
from pathlib import Path

from runs import ci_text, evaluation_folders, num_text, read_json, synthetic_classes  # bench/runs.py, beside this

log = logging.getLogger("bench")

PAIRS = ("qat-fp32", "ptq-fp32", "qat-ptq")


def run_kind(kind: str, work: Path, overrides: list[str]) -> dict:
    from qatpipe_pipelines.local_run import run_local

    sets = [f"dataset.synthetic.kind={kind}", f"dataset.classes={synthetic_classes(kind)}", *overrides]
    started = time.perf_counter()
    run_local(work / kind, "full", sets)
    return collect(kind, work, sets, time.perf_counter() - started)


def collect(kind: str, work: Path, sets: list[str], wall: float | None) -> dict:
    """One data set's figures from its finished run folder."""
    from qatpipe.stages.evaluate import METRICS_FILE
    from qatpipe.stages.train import SUMMARY_FILE as TRAIN_SUMMARY
    from qatpipe_pipelines.run_folder import RunFolder

    run = RunFolder(work / kind)
    summary = run.summary()
    train = run.find("train")
    train_summary = read_json(train / TRAIN_SUMMARY) if train else {}
    evaluations = {model: read_json(folder / METRICS_FILE) for model, folder in evaluation_folders(run.path).items()}
    fp32_metrics = evaluations.get("fp32", {})
    return {
        "kind": kind, "overrides": sets, "wall_seconds": None if wall is None else round(wall, 1),
        "variants": {name: {"map50": row["map50"], "map": row["map"],
                            "map50_ci95": [row.get("map50_ci95_lo"), row.get("map50_ci95_hi")]
                            if row.get("map50_ci95_lo") is not None else None,
                            **{key: row.get(key) for key in ("params", "gflops", "latency_ms_p50", "throughput",
                                                             "throughput_batch", "engine")}}
                     for name, row in summary["variants"].items()},
        "comparisons": summary.get("comparisons", {}),
        "stage_seconds": {name: row.get("seconds") for name, row in summary.get("stages", {}).items()},
        "run_wall_seconds": summary.get("wall_seconds"),  # the pipeline's own, also when the bench re-reads a run
        "pruning": summary.get("pruning", {}),
        "unpruned_map50": summary.get("pruning", {}).get("unpruned_map50"),
        "best_epoch": train_summary.get("best_epoch"), "epochs": train_summary.get("epochs"),
        "train_precision": train_summary.get("precision"),
        "train_images_per_second": train_summary.get("images_per_second"),
        "diagnostics": fp32_metrics.get("diagnostics", {}),
        "unpruned_diagnostics": evaluations.get("unpruned", {}).get("diagnostics", {}),
    }


def print_report(rows: list[dict]) -> None:
    print("\ndata set  variant  mAP@0.5  95% CI            mAP@[.5:.95]")
    for row in rows:
        for name, v in row["variants"].items():
            print(f"{row['kind']:<9} {name:<8} {v['map50']:.4f}   {ci_text(v['map50_ci95']):<17} {v['map']:.4f}")
    print("\ndata set  pair       mAP@0.5 diff (points)  95% CI (points)")
    for row in rows:
        for pair in PAIRS:
            c = row["comparisons"].get(pair, {}).get("map50")
            if c:
                print(f"{row['kind']:<9} {pair:<10} {100 * c['diff']:+8.2f}            "
                      f"[{100 * c['ci95'][0]:+.2f}, {100 * c['ci95'][1]:+.2f}]")
    print("\ndata set  FP32: class-agnostic mAP@0.5, class accuracy; unpruned mAP@0.5, best epoch; train img/s, "
          "precision; wall (s)")
    for row in rows:
        d = row["diagnostics"]
        cells = [num_text(d.get("class_agnostic_map50")), num_text(d.get("class_accuracy"), "{:.3f}"),
                 num_text(row["unpruned_map50"]), f"{row['best_epoch'] or 'n/a'}/{row['epochs'] or '?'}",
                 num_text(row["train_images_per_second"], "{:.1f}"), row["train_precision"] or "n/a",
                 num_text(row["wall_seconds"], "{:.0f}")]
        print(f"{row['kind']:<9} " + "  ".join(f"{cell:<12}" for cell in cells))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path("results/bench_recipe"))
    parser.add_argument("--kinds", nargs="+", default=["shapes", "glyphs", "photos"])
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--report", action="store_true", help="only re-read finished runs in WORK and print")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    os.environ.pop("MLFLOW_TRACKING_URI", None)  # each run's local SQLite store
    rows = []
    if args.report:
        walls = {row["kind"]: row.get("wall_seconds") for row in
                 (json.loads((args.work / "bench_recipe.json").read_text())
                  if (args.work / "bench_recipe.json").is_file() else [])}
        rows = [collect(kind, args.work, [], walls.get(kind)) for kind in args.kinds if (args.work / kind).is_dir()]
        print_report(rows)
        return
    for kind in args.kinds:
        if (args.work / kind).exists():
            raise SystemExit(f"{args.work / kind} exists: a cold run needs a fresh folder (this script never "
                             "deletes)")
        rows.append(run_kind(kind, args.work, args.overrides))
        (args.work / "bench_recipe.json").write_text(json.dumps(rows, indent=2) + "\n")
        print_report(rows)
    print(f"\nfigures: {args.work / 'bench_recipe.json'}")


if __name__ == "__main__":
    main()
