"""Benchmark: DetectNet_v2 against SSD on each synthetic data set (issue 35).

    python bench/detectors.py [--work DIR] [--kinds KIND ...] [--archs ARCH ...] [--train-only] [--set KEY=VALUE ...]

For each data set kind (default: shapes, glyphs, photos, traffic) and each model.arch (default: detectnet_v2,
ssd) it runs `qatpipe run --local` on the default spec with only `dataset.synthetic.kind`, the kind's classes and
`model.arch` changed (plus the `--set` overrides, the same for every run; no per-set tuning), and prints per run:
FP32 / PTQ / QAT mAP@0.5 with 95% bootstrap CIs, QAT - FP32 with its CI, AP@0.5 of the objects under 28 px wide
(class-aware and class-agnostic, pycocotools with the width as the area range), each variant's CPU engine img/s at
batch 8, the seconds inside the main job's training stages and the others, and the run's wall time (and its ratio
to the first arch's); per data set, the first arch's FP32 mAP@0.5 minus the second's with its paired CI. `--train-only`
runs train + evaluate (FP32, unpruned) instead of the whole pipeline.
Writes WORK/bench_detectors.json.

Targets: SSD FP32 mAP@0.5 >= 0.85 on every set; on traffic, SSD's AP@0.5 under 28 px >= DetectNet_v2's + 20
points; SSD QAT - FP32 >= -0.5 points; SSD's run within 1.5x DetectNet_v2's time.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import os
from pathlib import Path

from pretrained import map50_ci, run_pipeline, train_and_evaluate  # bench/pretrained.py, beside this script
from runs import ci_text, num_text  # bench/runs.py

KINDS = ("shapes", "glyphs", "photos", "traffic")
ARCHS = ("detectnet_v2", "ssd")
SMALL_PX = 28  # the small-object boundary: box width in input pixels

log = logging.getLogger("bench")


def kind_sets(kind: str) -> list[str]:
    from qatpipe.data.synth import KINDS as SYNTH_KINDS

    classes = SYNTH_KINDS[kind].classes
    return [f"dataset.synthetic.kind={kind}", f"dataset.classes=[{', '.join(classes)}]"]


def small_object_ap(evaluation: Path, max_width: float = SMALL_PX) -> dict:
    """AP@0.5 over the val objects narrower than `max_width` px: pycocotools with each box's width as its "area",
    so wider objects, and unmatched detections wider than the limit, are ignored (COCO's area-range rule).
    Class-aware (mAP over classes with such objects) and class-agnostic (every category merged)."""
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    from qatpipe.stages.evaluate import DETECTIONS_FILE, GROUND_TRUTH_FILE

    dataset = json.loads((evaluation / GROUND_TRUTH_FILE).read_text())
    results = json.loads((evaluation / DETECTIONS_FILE).read_text())
    figures = {"objects": sum(a["bbox"][2] < max_width for a in dataset["annotations"])}
    for agnostic in (False, True):
        data = json.loads(json.dumps(dataset))
        dets = json.loads(json.dumps(results))
        if agnostic:
            data["categories"] = [{"id": 1, "name": "object"}]
            for item in (*data["annotations"], *dets):
                item["category_id"] = 1
        for item in data["annotations"]:
            item["area"] = item["bbox"][2]
        with contextlib.redirect_stdout(io.StringIO()):
            coco = COCO()
            coco.dataset = data
            coco.createIndex()
            found = coco.loadRes(dets) if dets else COCO()
            for det in found.dataset.get("annotations", []):
                det["area"] = det["bbox"][2]
            evaluator = COCOeval(coco, found, "bbox")
            evaluator.params.areaRng, evaluator.params.areaRngLbl = [[0, max_width]], ["small"]
            evaluator.params.iouThrs = evaluator.params.iouThrs[:1]  # 0.5
            evaluator.params.maxDets = [100]
            evaluator.evaluate()
            evaluator.accumulate()
        precision = evaluator.eval["precision"][0, :, :, 0, 0]  # (recall, class)
        per_class = [precision[:, k][precision[:, k] > -1].mean() for k in range(precision.shape[1])
                     if (precision[:, k] > -1).any()]
        figures["agnostic" if agnostic else "map50"] = round(float(sum(per_class) / len(per_class)), 4) \
            if per_class else None
    return figures


def arch_difference(evaluations: dict[str, Path]) -> dict:
    """The first arch's FP32 mAP@0.5 minus the second's with its 95% CI, bootstrapped over the same val images
    (paired, as compare does: 1,000 resamples)."""
    from qatpipe.metrics.bootstrap import match_detections, paired_bootstrap
    from qatpipe.stages.evaluate import DETECTIONS_FILE, GROUND_TRUTH_FILE

    matched = {arch: match_detections(json.loads((folder / GROUND_TRUTH_FILE).read_text()),
                                      json.loads((folder / DETECTIONS_FILE).read_text()))
               for arch, folder in evaluations.items()}
    first, second = matched
    return paired_bootstrap(matched, [(first, second)])["pairs"][f"{first}-{second}"]["map50"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path("bench_work/detectors"))
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    parser.add_argument("--archs", nargs="+", default=list(ARCHS), choices=ARCHS)
    parser.add_argument("--train-only", action="store_true", help="train + evaluate (FP32) instead of the pipeline")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    os.environ.pop("MLFLOW_TRACKING_URI", None)  # each run's local SQLite store (mlflow 3 refuses a file store)
    args.work.mkdir(parents=True, exist_ok=True)
    rows = []
    for kind in args.kinds:
        for arch in args.archs:
            name = f"{kind}_{arch}"
            sets = [*kind_sets(kind), f"model.arch={arch}", *args.overrides]
            runner = train_and_evaluate if args.train_only else run_pipeline
            row = {**runner(name, args.work, sets), "kind": kind, "arch": arch}  # collect() names the run "kind"
            row["small"] = small_object_ap(Path(row["evaluation"]))
            if "map50_ci95" not in row["variants"]["fp32"] or row["variants"]["fp32"]["map50_ci95"] is None:
                row["variants"]["fp32"]["map50_ci95"] = map50_ci(Path(row["evaluation"]))
            rows.append(row)
            (args.work / "bench_detectors.json").write_text(json.dumps(rows, indent=2) + "\n")
            log.info("%s: %s", name, json.dumps({k: row[k] for k in ("variants", "small")}))
    report(rows)


TRAINING_STAGES = ("train", "retrain-fp32", "finetune-fp32", "retrain-qat")  # the main job's training tasks


def report(rows: list[dict]) -> None:
    print(f"\ndata set  arch          variant      mAP@0.5  95% CI            img/s @8  AP@0.5 <{SMALL_PX}px "
          "(agnostic, objects)")
    for row in rows:
        small = row["small"]
        for name, v in row["variants"].items():
            fp32 = name == "fp32" and small["map50"] is not None
            print(f"{row['kind']:<9} {row['arch']:<13} {name:<12} {v['map50']:.4f}   "
                  f"{ci_text(v.get('map50_ci95')):<17} "
                  f"{num_text(v.get('throughput'), '{:.1f}'):<9} "
                  + (f"{small['map50']:.4f} ({num_text(small['agnostic'])}, {small['objects']})" if fp32 else ""))
    for kind in dict.fromkeys(row["kind"] for row in rows):
        runs = {row["arch"]: Path(row["evaluation"]) for row in rows if row["kind"] == kind}
        if len(runs) == 2:
            diff = arch_difference(runs)
            print(f"{kind:<9} {' - '.join(runs)} FP32 mAP@0.5 {100 * diff['diff']:+.2f} points "
                  f"[{100 * diff['ci95'][0]:+.2f}, {100 * diff['ci95'][1]:+.2f}] (paired over the val images)")
    for row in rows:
        c = row.get("comparisons", {}).get("qat-fp32", {}).get("map50")
        if c:
            print(f"{row['kind']:<9} {row['arch']:<13} qat - fp32 {100 * c['diff']:+.2f} points "
                  f"[{100 * c['ci95'][0]:+.2f}, {100 * c['ci95'][1]:+.2f}]")
    print("\nmain-job seconds inside the stages (" + " / ".join(TRAINING_STAGES) + " / all other stages) and wall")
    walls = {}
    for row in rows:
        stages = row.get("stage_seconds")
        if not stages:  # a --train-only row
            continue
        wall = row.get("run_wall_seconds") or row.get("wall_seconds")
        walls[row["kind"], row["arch"]] = wall
        cells = [num_text(stages.get(name), "{:.0f}") for name in TRAINING_STAGES]
        rest = sum(s or 0 for name, s in stages.items() if name not in TRAINING_STAGES)
        print(f"{row['kind']:<9} {row['arch']:<13} {' / '.join(cells)} / {rest:.0f}   wall {num_text(wall, '{:.0f}')}")
    for (kind, arch), wall in walls.items():  # each arch's wall over DetectNet_v2's (the issue's 1.5x)
        base = walls.get((kind, ARCHS[0]))
        if arch != ARCHS[0] and base and wall:
            print(f"{kind:<9} {arch} wall / {ARCHS[0]}'s: {wall / base:.2f}x")


if __name__ == "__main__":
    main()
