"""Benchmark: the backbones on the whole pipeline, FP32 / PTQ / QAT each (issue "Backbones where PTQ breaks").

    python bench/backbones.py [--work DIR] [--backbones NAME ...] [--set KEY=VALUE ...]

For each backbone (default: every one in spec/registries.py's BACKBONES) it runs `qatpipe run --local` on the
full spec with only `model.backbone.name` (and the `--set` overrides, the same for every backbone) changed,
and prints per backbone: the deployed (pruned) model's params and GFLOPs, FP32 / PTQ / QAT mAP@0.5 with their
95% bootstrap CIs over the val images, the paired differences QAT - FP32, PTQ - FP32 and QAT - PTQ with their
CIs, each variant's CPU engine latency (p50, batch 1), pruning's FLOPs ratio, the unpruned model's mAP@0.5, and
the wall time.
Writes WORK/bench_backbones.json.

`--qat-from-fp32` re-runs each finished run's QAT retrain from its retrained FP32 model (the QAT toolkit's
fine-tuning) instead of the pruned model (TAO's recipe), and prints QAT - FP32 with its CI. `--fp32-longer` is
its control: the FP32 retrain continued for as many epochs, and QAT-from-FP32 against it (the same training).
`--ptq-sweep` then re-quantizes each finished run's FP32 ONNX with other PTQ settings (method minmax /
entropy / percentile, 16 or 200 calibration images) and prints each one's mAP@0.5 and its paired difference
from FP32 with the CI: where the pipeline's PTQ loses nothing, this finds the settings where it does.

Target: QAT within 0.5 points of FP32 on every backbone. Where PTQ loses nothing, the figures say so.
"""

import argparse
import json
import logging
import os
import time
from pathlib import Path

from recipe import PAIRS, collect  # bench/recipe.py, beside this script
from runs import ci_text, num_text  # bench/runs.py

from qatpipe.models.backbones import BACKBONES

log = logging.getLogger("bench")


def run_backbone(backbone: str, work: Path, overrides: list[str]) -> dict:
    from qatpipe_pipelines.local_run import run_local

    sets = [f"model.backbone.name={backbone}", *overrides]
    started = time.perf_counter()
    run_local(work / backbone, "full", sets)
    return describe(backbone, work, sets, time.perf_counter() - started)


def describe(backbone: str, work: Path, sets: list[str], wall: float | None) -> dict:
    return {"backbone": backbone, **collect(backbone, work, sets, wall)}


def _finished_run(backbone: str, work: Path) -> dict:
    """What the follow-up experiments read from a finished run: the FP32 model's evaluation folder and ONNX,
    and the retrain specs by qat.enabled (False: the FP32 retrain's, True: the QAT retrain's)."""
    from qatpipe_pipelines.run_folder import RunFolder

    run = RunFolder(work / backbone)
    return {"fp32_eval": run.stage("evaluate_fp32"), "fp32_onnx": run.variant("fp32").onnx,
            # the retrains of the pruned model (not finetune_fp32, which a run in the fine-tuning order also has)
            "specs": {False: run.stage("retrain_fp32") / "spec.yaml", True: run.stage("retrain_qat") / "spec.yaml"}}


def _scored_against_fp32(spec, onnx: Path, folder: Path, fp32_eval: Path, variant: str) -> tuple[float, dict]:
    """mAP@0.5 of `onnx` on the val set, and the paired bootstrap of `variant` - fp32 over the same images."""
    from qatpipe.stages.compare import uncertainty
    from qatpipe.stages.evaluate import evaluate

    result = evaluate(spec, onnx, folder / "evaluation")
    pairs = uncertainty({"fp32": fp32_eval, variant: folder / "evaluation"})["pairs"]
    return result["map50"], pairs[f"{variant}-fp32"]["map50"]


SWEEP = (("minmax", 16), ("minmax", 200), ("entropy", 16), ("entropy", 200), ("percentile", 16),
         ("percentile", 200))


def ptq_sweep(backbone: str, work: Path) -> list[dict]:
    """Each SWEEP setting on the finished run's FP32 ONNX: PTQ, evaluation, paired bootstrap against FP32."""
    from qatpipe.spec import load_spec
    from qatpipe.stages.ptq import ptq

    run = _finished_run(backbone, work)
    spec = load_spec(run["specs"][False])
    rows = []
    for method, images in SWEEP:
        spec.ptq.method, spec.ptq.calibration_images = method, images
        folder = work / f"{backbone}_ptq_sweep" / f"{method}_{images}"
        ptq(spec, run["fp32_onnx"], folder / "model.onnx")
        map50, pair = _scored_against_fp32(spec, folder / "model.onnx", folder, run["fp32_eval"], "ptq")
        rows.append({"backbone": backbone, "method": method, "calibration_images": images,
                     "map50": map50, "diff": pair["diff"], "ci95": pair["ci95"]})
        log.info("%s PTQ %s/%d: mAP@0.5 %.4f (%+.2f points vs FP32)", backbone, method, images, map50,
                 100 * pair["diff"])
    return rows


def _retrained_from_fp32(backbone: str, work: Path, qat: bool, name: str) -> tuple[dict, Path, float, dict]:
    """(the spec, its folder, mAP@0.5, the paired difference from the FP32 model) of the run's QAT (`qat`) or
    FP32 retrain, same spec, epochs and schedule, started from its retrained FP32 model, into WORK/<name>."""
    from qatpipe.spec import load_spec
    from qatpipe.stages.export import export
    from qatpipe.stages.retrain import retrain

    run = _finished_run(backbone, work)
    spec = load_spec(run["specs"][qat])
    folder = work / name
    summary = retrain(spec, run["specs"][False].with_name("model.keras"), folder / "retrain")
    export(spec, summary["model"], folder / "model.onnx")
    map50, pair = _scored_against_fp32(spec, folder / "model.onnx", folder, run["fp32_eval"], "qat")
    return spec, folder, map50, pair


def qat_from_fp32(backbone: str, work: Path) -> dict:
    """The run's QAT retrain started from its retrained FP32 model instead of the pruned one, as NVIDIA's QAT
    toolkit fine-tunes a trained model: exported, evaluated and compared with the FP32 model by the paired
    bootstrap."""
    spec, _, map50, pair = _retrained_from_fp32(backbone, work, True, f"{backbone}_qat_from_fp32")
    row = {"backbone": backbone, "start": "fp32 retrained", "epochs": spec.retrain.epochs,
           "map50": map50, "diff": pair["diff"], "ci95": pair["ci95"]}
    print(f"\n{backbone}: QAT from the FP32 model ({row['epochs']} epochs): mAP@0.5 {row['map50']:.4f}, QAT - FP32 "
          f"{100 * row['diff']:+.2f} points [{100 * row['ci95'][0]:+.2f}, {100 * row['ci95'][1]:+.2f}]")
    return row


def fp32_longer(backbone: str, work: Path) -> dict:
    """The control for --qat-from-fp32: the run's FP32 retrain continued for the same epochs from its retrained
    FP32 model, so FP32 and QAT have had the same training. Compared with the FP32 model, and with the
    QAT-from-FP32 model when that experiment has run (the like-for-like QAT - FP32)."""
    from qatpipe.stages.compare import uncertainty

    spec, folder, map50, pair = _retrained_from_fp32(backbone, work, False, f"{backbone}_fp32_longer")
    row = {"backbone": backbone, "start": "fp32 retrained", "epochs": spec.retrain.epochs, "map50": map50,
           "diff_vs_fp32": pair["diff"], "ci95_vs_fp32": pair["ci95"]}
    print(f"\n{backbone}: FP32 continued {row['epochs']} epochs: mAP@0.5 {map50:.4f}, against the FP32 model "
          f"{100 * pair['diff']:+.2f} points [{100 * pair['ci95'][0]:+.2f}, {100 * pair['ci95'][1]:+.2f}]")
    qat_eval = work / f"{backbone}_qat_from_fp32" / "evaluation"
    if qat_eval.is_dir():
        like = uncertainty({"fp32": folder / "evaluation", "qat": qat_eval})["pairs"]["qat-fp32"]["map50"]
        row.update(qat_minus_fp32=like["diff"], qat_minus_fp32_ci95=like["ci95"])
        print(f"{backbone}: QAT from FP32 - FP32 continued, the same training: {100 * like['diff']:+.2f} points "
              f"[{100 * like['ci95'][0]:+.2f}, {100 * like['ci95'][1]:+.2f}]")
    return row


def export_qat(backbone: str, work: Path) -> dict:
    """The run's QAT retrain's model exported again by the current export stage (a run whose QAT export an
    earlier check refused), then scored as the pipeline scores a variant: its CPU engine (evaluate) and
    TensorRT's numbers (validate's exact form), paired against the run's FP32 and PTQ evaluations and their
    TensorRT numbers."""
    from qatpipe.spec import load_spec
    from qatpipe.stages.compare import uncertainty
    from qatpipe.stages.evaluate import evaluate
    from qatpipe.stages.export import export
    from qatpipe.stages.validate import EMULATED_FOLDER, exact_form_map50

    from qatpipe_pipelines.run_folder import RunFolder

    run = RunFolder(work / backbone)
    spec_path = _finished_run(backbone, work)["specs"][True]
    spec = load_spec(spec_path)
    folder = work / f"{backbone}_qat_export"
    report = export(spec, spec_path.with_name("model.keras"), folder / "model.onnx")
    check = report["layer_check"]
    engine = evaluate(spec, folder / "model.onnx", folder / "evaluation")["map50"]
    tensorrt = exact_form_map50(spec, folder / "model.onnx", folder / "exact", "qat")
    # PTQ's engine as its validation scored it (the pipeline scores an INT8 model once, there)
    fp32, ptq = run.stage("evaluate_fp32"), run.stage("validate_ptq")
    ptq_trt, fp32_trt = ptq / EMULATED_FOLDER, run.stage("validate_fp32") / EMULATED_FOLDER
    engine_run = uncertainty({"fp32": fp32, "ptq": ptq, "qat": folder / "evaluation"})
    numbers_run = uncertainty({"fp32": fp32_trt, "ptq": ptq_trt, "qat": folder / "exact"})
    engines, numbers = engine_run["pairs"], numbers_run["pairs"]
    row = {"backbone": backbone, "layers_checked": check["checked"], "layers_failed": list(check["failed"]),
           "closest_layer": check["worst"], "end_to_end": report["difference_vs_tensorflow"],
           "end_to_end_limits": report["difference_limits"], "qat_map50": engine, "qat_map50_tensorrt": tensorrt,
           **{f"{pair}{suffix}": {k: pairs[pair]["map50"][k] for k in ("diff", "ci95")}
              for suffix, pairs in (("", engines), ("_tensorrt", numbers)) for pair in ("qat-fp32", "qat-ptq",
                                                                                        "ptq-fp32")}}
    print(f"\n{backbone}: QAT export: {check['checked']} layers checked, {len(check['failed'])} failed; end to end "
          + ", ".join(f"{name} 90th/99th {d['p90_steps']:.2f}/{d['p99_steps']:.2f} steps (limits "
                      f"{report['difference_limits'][name]['p90_steps']:.2f}/"
                      f"{report['difference_limits'][name]['p99_steps']:.2f})"
                      for name, d in report["difference_vs_tensorflow"].items()))
    for label, scored in (("CPU engines", engine_run), ("TensorRT's numbers", numbers_run)):
        print(f"{backbone}: mAP@0.5 ({label}) " + ", ".join(
            f"{name} {scored['variants'][name]['map50']['value']:.4f}" for name in ("fp32", "ptq", "qat")))
    for key in ("qat-fp32", "qat-ptq", "ptq-fp32", "qat-fp32_tensorrt", "qat-ptq_tensorrt", "ptq-fp32_tensorrt"):
        print(f"  {key:<18} {100 * row[key]['diff']:+.2f} points [{100 * row[key]['ci95'][0]:+.2f}, "
              f"{100 * row[key]['ci95'][1]:+.2f}]")
    return row


def print_sweep(rows: list[dict]) -> None:
    print("\nbackbone         PTQ method  calib. images  mAP@0.5  PTQ - FP32 (points)  95% CI (points)")
    for r in rows:
        print(f"{r['backbone']:<16} {r['method']:<11} {r['calibration_images']:<14} {r['map50']:.4f}   "
              f"{100 * r['diff']:+8.2f}             [{100 * r['ci95'][0]:+.2f}, {100 * r['ci95'][1]:+.2f}]")


def print_report(rows: list[dict]) -> None:
    print("\nbackbone         variant  params     GFLOPs  mAP@0.5  95% CI            latency p50 (ms)  engine")
    for row in rows:
        for name, v in row["variants"].items():
            print(f"{row['backbone']:<16} {name:<8} {v.get('params') or 0:<10} "
                  f"{num_text(v.get('gflops'), '{:.3f}'):<7} {v['map50']:.4f}   {ci_text(v['map50_ci95']):<17} "
                  f"{num_text(v.get('latency_ms_p50'), '{:.3f}'):<17} "
                  f"{v.get('engine') or 'n/a'}")
    print("\nbackbone         pair       mAP@0.5 diff (points)  95% CI (points)")
    for row in rows:
        for pair in PAIRS:
            c = row["comparisons"].get(pair, {}).get("map50")
            if c:
                print(f"{row['backbone']:<16} {pair:<10} {100 * c['diff']:+8.2f}            "
                      f"[{100 * c['ci95'][0]:+.2f}, {100 * c['ci95'][1]:+.2f}]")
    print("\nbackbone         pruning FLOPs ratio  unpruned mAP@0.5  best epoch  train img/s  wall (s)")
    for row in rows:
        print(f"{row['backbone']:<16} {num_text(row['pruning'].get('flops_ratio'), '{:.3f}'):<20} "
              f"{num_text(row['unpruned_map50']):<17} {row['best_epoch'] or 'n/a'}/{row['epochs'] or '?':<8} "
              f"{num_text(row['train_images_per_second'], '{:.1f}'):<12} {num_text(row['wall_seconds'], '{:.0f}')}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path("results/bench_backbones"))
    parser.add_argument("--backbones", nargs="+", choices=list(BACKBONES), default=list(BACKBONES))
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--report", action="store_true", help="only re-read finished runs in WORK and print")
    parser.add_argument("--ptq-sweep", action="store_true",
                        help="re-quantize each finished run's FP32 model with other PTQ settings (no training)")
    parser.add_argument("--fp32-longer", action="store_true",
                        help="continue each finished run's FP32 retrain for the same epochs (--qat-from-fp32's "
                             "control) and compare")
    parser.add_argument("--export-qat", action="store_true",
                        help="export each finished run's QAT retrain again with the current export stage (a run "
                             "whose QAT export an earlier check refused) and score it against FP32 and PTQ")
    parser.add_argument("--qat-from-fp32", action="store_true",
                        help="re-run each finished run's QAT retrain from its FP32 model instead of the pruned one")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    os.environ.pop("MLFLOW_TRACKING_URI", None)  # each run's local SQLite store
    saved = args.work / "bench_backbones.json"
    if args.fp32_longer:
        rows = [fp32_longer(b, args.work) for b in args.backbones if (args.work / b).is_dir()]
        (args.work / "bench_backbones_fp32_longer.json").write_text(json.dumps(rows, indent=2) + "\n")
        return
    if args.export_qat:
        rows = [export_qat(b, args.work) for b in args.backbones if (args.work / b).is_dir()]
        (args.work / "bench_backbones_export_qat.json").write_text(json.dumps(rows, indent=2) + "\n")
        return
    if args.qat_from_fp32:
        rows = [qat_from_fp32(b, args.work) for b in args.backbones if (args.work / b).is_dir()]
        (args.work / "bench_backbones_qat_from_fp32.json").write_text(json.dumps(rows, indent=2) + "\n")
        return
    if args.ptq_sweep:
        rows = [row for b in args.backbones if (args.work / b).is_dir() for row in ptq_sweep(b, args.work)]
        (args.work / "bench_backbones_ptq_sweep.json").write_text(json.dumps(rows, indent=2) + "\n")
        print_sweep(rows)
        return
    if args.report:
        previous = {row["backbone"]: row for row in (json.loads(saved.read_text()) if saved.is_file() else [])
                    if "failed" not in row}
        rows = [describe(b, args.work, previous.get(b, {}).get("overrides", []),
                         previous.get(b, {}).get("wall_seconds"))
                for b in args.backbones if (args.work / b / "summary.json").is_file()]  # finished runs only
        print_report(rows)
        return
    from qatpipe_pipelines.local_run import PipelineFailed

    rows, failed = [], []
    for backbone in args.backbones:
        if (args.work / backbone).exists():
            raise SystemExit(f"{args.work / backbone} exists: a cold run needs a fresh folder (this script never "
                             "deletes)")
        try:
            rows.append(run_backbone(backbone, args.work, args.overrides))
        except PipelineFailed as failure:  # report it and go on: the other backbones' figures still count
            log.error("%s: %s", backbone, failure)
            failed.append({"backbone": backbone, "failed": str(failure)})
        saved.write_text(json.dumps(rows + failed, indent=2) + "\n")
        print_report(rows)
    for row in failed:
        print(f"\n{row['backbone']} FAILED: {row['failed']}")
    print(f"\nfigures: {saved}")


if __name__ == "__main__":
    main()
