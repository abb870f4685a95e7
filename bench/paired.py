"""Benchmark helper: the paired mAP difference between two evaluations of the same val set.

    python bench/paired.py EVAL_A EVAL_B [--names A B]
    python bench/paired.py --runs RUN_A RUN_B

EVAL_A and EVAL_B are evaluation folders (`qatpipe evaluate -o DIR`, or an evaluate task's output) holding
`ground_truth.json` and `detections.json`. Prints each one's mAP@0.5 and mAP@[.5:.95] and the difference B - A
with its 95% CI from the paired bootstrap over the val images (1,000 resamples, seed 0), the one `compare` uses.

With `--runs`, two finished `qatpipe run --local` folders of the same val set (e.g. a recipe against `make
main`'s results/pipeline): the same for each model both runs scored (unpruned and fp32 by their evaluate tasks;
ptq, ptq-partial and qat by their validate tasks, as the pipeline scores an INT8 model), B's minus A's. The
spread between training runs is not in these CIs.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from qatpipe_pipelines.run_folder import RunFolder, variant_stage

# the models a run scores, by the stage that scores them (runs before the INT8 evaluate tasks went: those too)
SCORED = {"unpruned": ("evaluate",), "fp32": ("evaluate",), "ptq": ("validate", "evaluate"),
          "ptq-partial": ("validate", "evaluate"), "qat": ("validate", "evaluate")}


def paired_difference(first: Path, second: Path, names: tuple[str, str] = ("a", "b")) -> dict:
    """{metric: {names[0]: value, names[1]: value, "diff": second - first, "ci95": [lo, hi]}, "images": n}."""
    from qatpipe.metrics.bootstrap import match_detections, paired_bootstrap
    from qatpipe.stages.evaluate import DETECTIONS_FILE, GROUND_TRUTH_FILE

    truths = [json.loads((folder / GROUND_TRUTH_FILE).read_text()) for folder in (first, second)]
    if truths[0] != truths[1]:
        raise SystemExit(f"{first} and {second} were scored on different val sets")
    matched = {name: match_detections(truths[0], json.loads((folder / DETECTIONS_FILE).read_text()))
               for name, folder in zip(names, (first, second))}
    pair = f"{names[1]}-{names[0]}"
    boot = paired_bootstrap(matched, [(names[1], names[0])])
    return {"images": boot["images"], **{
        metric: {**{name: boot["variants"][name][metric]["value"] for name in names},
                 "diff": boot["pairs"][pair][metric]["diff"], "ci95": boot["pairs"][pair][metric]["ci95"]}
        for metric in ("map50", "map")}}


def run_differences(first: Path, second: Path) -> dict:
    """model -> paired_difference(first run's evaluation, second's) for each model both runs scored, by the
    same kind of stage."""
    runs = RunFolder(first), RunFolder(second)
    rows = {}
    for model, kinds in SCORED.items():
        for stage in (variant_stage(kind, model) for kind in kinds):
            a, b = (run.find(stage) for run in runs)
            if a and b:
                rows[model] = paired_difference(a, b, ("a", "b"))
                break
    if not rows:
        raise SystemExit(f"{first} and {second}: no model that both evaluated")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("first", type=Path, nargs="?")
    parser.add_argument("second", type=Path, nargs="?")
    parser.add_argument("--names", nargs=2, default=["a", "b"])
    parser.add_argument("--runs", nargs=2, type=Path, metavar=("RUN_A", "RUN_B"))
    args = parser.parse_args()
    if args.runs:
        rows = run_differences(*args.runs)
        print(f"mAP@0.5, {args.runs[1]} - {args.runs[0]}, paired bootstrap over "
              f"{next(iter(rows.values()))['images']} val images (1000 resamples, seed 0)")
        print(f"{'model':<12} {'A':>8} {'B':>8}  B - A (points)  95% CI (points)")
        for model, pair in rows.items():
            r = pair["map50"]
            print(f"{model:<12} {r['a']:8.4f} {r['b']:8.4f}  {100 * r['diff']:+8.2f}        "
                  f"[{100 * r['ci95'][0]:+.2f}, {100 * r['ci95'][1]:+.2f}]")
        return
    if not (args.first and args.second):
        parser.error("name two evaluation folders, or --runs RUN_A RUN_B")
    result = paired_difference(args.first, args.second, tuple(args.names))
    a, b = args.names
    print(f"paired bootstrap over {result['images']} val images (1000 resamples, seed 0)")
    print(f"metric        {a:>10} {b:>10}  {b} - {a} (points)  95% CI (points)")
    for metric, label in (("map50", "mAP@0.5"), ("map", "mAP@[.5:.95]")):
        r = result[metric]
        print(f"{label:<13} {r[a]:10.4f} {r[b]:10.4f}  {100 * r['diff']:+8.2f}            "
              f"[{100 * r['ci95'][0]:+.2f}, {100 * r['ci95'][1]:+.2f}]")


if __name__ == "__main__":
    main()
