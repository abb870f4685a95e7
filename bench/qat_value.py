"""Benchmark: what QAT adds where it counts (issue 37): FP32, PTQ, PTQ-partial, QAT and QAT + distillation.

    python bench/qat_value.py [--work DIR] [--backbones mobilenet_v2 ...] [--distill-weight W] [--set KEY=VALUE ...]
                              [--qat-auto] [--qat-freeze N] [--qat-start START] [--fp32-longer] [--no-pipeline]

Per backbone it runs the whole pipeline (`qatpipe run --local`, full spec, only `model.backbone.name` and the
`--set` overrides changed; the val set is the default's), which measures the sensitivity of the PTQ and QAT
models and makes the ptq-partial variant (`ptq.keep_float: auto`). Then QAT + distillation (none with W 0): the
run's own QAT retrain spec with `qat.distill_weight` W, from the same start (the FP32 retrain's model, also the
teacher), exported, built into an engine and evaluated on the same val images; with --qat-auto, the same again with
`qat.excluded_layers: auto` (the variant qat-auto: the layers partial PTQ of that start keeps float stay float);
with --qat-freeze N, with BatchNormalization statistics and activation ranges frozen after N epochs (qat-freeze:
`qat.bn_update_epochs` and `qat.range_update_epochs` N); with --qat-start START, QAT again from where `qat.start`
START begins it (qat-START: fp32 fine-tunes the FP32 retrain's model, baseline fine-tunes the run's FP32 baseline
briefly, pruned retrains the pruned model; stages/retrain_plan.py), for as long as that order trains it; with
--fp32-longer, the control of qat.start baseline: the run's FP32 baseline fine-tuned again as that order's QAT
fine-tunes it (qat.epochs under qat.learning_rate), in FP32 (fp32-longer: what those epochs give without
quantization; the QAT variants are also paired against it).

Prints per backbone and variant: mAP@0.5 with its 95% bootstrap CI, the paired difference from FP32 and from PTQ
with CIs, the compute layers INT8 / FP16 / FP32 of its engine's ONNX, how many layers ptq-partial kept float and
whether that met the budget, the CPU engines' throughput at batch 8 and speed-up over FP32 (the engines the
pipeline built and validated, the exact CPU form, timed here once a round for 5 rounds in one process: a slow
spell of the machine hits all alike and shows as the speed-up's range over the rounds), the CI half-width of
QAT - FP32, and the wall time of each part. Writes WORK/bench_qat_value.json.

Targets (issue 37): on at least one depthwise backbone QAT (with or without distillation) beats PTQ with a CI
that excludes 0 and sits within 0.5 points of FP32; ptq-partial reaches the budget with the fewest float layers
the ranking allows; QAT - FP32's CI half-width <= 0.5 points on the default run.
"""

import argparse
import json
import logging
import os
import time
from pathlib import Path

from runs import ci_text, median_round, read_json, speedup_range, time_in_rounds  # bench/runs.py, beside this

from qatpipe_pipelines.run_folder import RunFolder, variant_stage

log = logging.getLogger("bench")

VARIANTS = ("fp32", "ptq", "ptq-partial", "qat", "qat+distill")
# the extra QAT retrains beside the pipeline's, by variant: their folder under WORK/<backbone>_<folder> and the qat
# settings they change; qat-auto only with --qat-auto, qat-freeze only with --qat-freeze, qat-START with --qat-start
STARTS = ("fp32", "baseline", "pruned")
EXTRA_QAT = {"qat+distill": "distill", "qat-auto": "qat_auto", "qat-freeze": "qat_freeze",
             **{f"qat-{start}": f"qat_{start}" for start in STARTS}}
# extra retrains whose model has the QAT model's graph (layers, speed)
QAT_GRAPH = ("qat+distill", "qat-freeze", *(f"qat-{start}" for start in STARTS))
FP32_LONGER = "fp32-longer"  # the FP32 control of qat.start baseline's QAT fine-tuning (--fp32-longer)
EXTRA_QAT[FP32_LONGER] = "fp32_longer"


def run_backbone(backbone: str, work: Path, overrides: list[str], distill_weight: float, qat_auto: bool,
                 before: dict | None = None, qat_freeze: int | None = None, qat_start: str | None = None,
                 fp32_longer: bool = False) -> dict:
    """The pipeline run (none where `before`, the row of a finished one, is given), then the extra QAT
    retrains it lacks."""
    from qatpipe_pipelines.local_run import run_local

    sets = [f"model.backbone.name={backbone}", *overrides]
    if before is None:
        started = time.perf_counter()
        run_local(work / backbone, "full", sets)
        wall, seconds = round(time.perf_counter() - started, 1), {}
    else:  # the times stay those of the runs that made them
        wall, seconds = before.get("wall_seconds"), extra_seconds(before)
    extra = {"qat+distill": {"distill_weight": distill_weight}} if distill_weight else {}
    if qat_auto:
        extra["qat-auto"] = {"excluded_layers": "auto"}
    if qat_freeze is not None:
        extra["qat-freeze"] = {"bn_update_epochs": qat_freeze, "range_update_epochs": qat_freeze}
    if qat_start is not None:
        extra[f"qat-{qat_start}"] = {"start": qat_start}
    if fp32_longer:
        extra[FP32_LONGER] = {"enabled": False}
    for variant, settings in extra.items():
        started = time.perf_counter()
        if retrained_qat(backbone, work, EXTRA_QAT[variant], settings):
            seconds[variant] = round(time.perf_counter() - started, 1)
    return describe(backbone, work, sets, wall, seconds)


def extra_seconds(row: dict) -> dict[str, float]:
    """A JSON row's seconds per extra QAT retrain (rows of the script before qat-auto: distill_seconds alone)."""
    return dict(row.get("extra_qat_seconds") or (
        {"qat+distill": row["distill_seconds"]} if row.get("distill_seconds") else {}))


def retrained_qat(backbone: str, work: Path, folder_name: str, settings: dict) -> bool:
    """The run's QAT retrain again with the qat `settings` changed, under the spec the run resolved, from where its
    qat.start (or the one `settings` sets) begins QAT (the model it starts from is also distillation's teacher);
    exported, built into an engine as the pipeline builds them (exact CPU form here) and evaluated into
    WORK/<backbone>_<folder_name>. False where it had been (its engine is built where an older run of this
    script did not)."""
    from qatpipe.data.prepare import spec_with_prepared_dataset
    from qatpipe.stages.build_engine import build_engine
    from qatpipe.stages.evaluate import evaluate
    from qatpipe.stages.export import export
    from qatpipe.stages.retrain import retrain
    from qatpipe.stages.retrain_plan import FINETUNE_FP32, plan_retrain

    folder = work / f"{backbone}_{folder_name}"
    run = RunFolder(work / backbone)
    spec = spec_with_prepared_dataset(run.spec(), run.stage("prepare_data"))
    done = (folder / "evaluation" / "metrics.json").is_file()
    if not done:
        spec.qat.enabled = True
        for key, value in settings.items():
            setattr(spec.qat, key, value)
        qat = spec.qat.enabled
        # QAT from where qat.start begins it, as long as that order trains it (stages/retrain_plan.py); the FP32
        # control (qat.enabled False) trains as qat.start baseline's QAT does, recorded as the FP32 baseline
        order = spec if qat else spec.model_copy(update={"qat": spec.qat.model_copy(update={"start": "baseline"})})
        plan = plan_retrain(order, True, *(run.stage(stage) / "model.keras"
                                           for stage in ("prune", "retrain_fp32", "finetune_fp32")))
        summary = retrain(plan.applied(spec), plan.source, folder / "retrain",
                          stage_name=plan.stage_name if qat else FINETUNE_FP32)
        export(spec, summary["model"], folder / "model.onnx")
    if not (folder / "engine" / "engine.json").is_file():
        build_engine(spec, folder / "model.onnx", folder / "engine", backend="onnxruntime")
    if not done:
        evaluate(spec, folder / "model.onnx", folder / "evaluation")
    return not done


def describe(backbone: str, work: Path, sets: list[str], wall: float | None, seconds: dict[str, float]) -> dict:
    from qatpipe.stages.compare import uncertainty

    run = RunFolder(work / backbone)
    summary = run.summary()
    # the pipeline's variants as compare scores them: their validate tasks' engines (TensorRT's numbers: the
    # exact CPU form here), not the evaluate tasks' ONNX Runtime runs of the ONNX as it is, where PTQ's
    # BN-folded convolutions run in ONNX Runtime's own int8 kernels (on this CPU without VNNI they gave MobileNetV2
    # 0.8459 against 0.8201). QAT-style exports (the extra retrains') do not fuse: their evaluations are exact.
    evaluations = {name: run.stage(variant_stage("validate", name)) for name in VARIANTS[:4]}
    extra = {name: work / f"{backbone}_{folder}" for name, folder in EXTRA_QAT.items()
             if (work / f"{backbone}_{folder}" / "evaluation" / "metrics.json").is_file()}
    evaluations.update({name: folder / "evaluation" for name, folder in extra.items()})
    pairs = [(v, "fp32") for v in evaluations if v != "fp32"] + [(v, "ptq") for v in evaluations
                                                                 if v not in ("fp32", "ptq")] + [
        (v, "qat") for v in extra if v != FP32_LONGER] + [  # what each change gained over the pipeline's QAT
        (v, FP32_LONGER) for v in evaluations if FP32_LONGER in extra and (v == "qat" or v in QAT_GRAPH)]
    scored = uncertainty(evaluations, pairs=pairs)
    partial = read_json(run.stage("ptq_partial") / "ptq_partial.json")
    engines = {name: variant.engine for name, variant in run.variants().items() if variant.engine}
    engines.update({name: folder / "engine" for name, folder in extra.items() if (folder / "engine").is_dir()})
    speeds = engine_speeds(engines, run.spec().dataset.image_size)
    variants = {}
    for name in evaluations:
        row = summary.get("variants", {}).get("qat" if name in QAT_GRAPH else "fp32" if name == FP32_LONGER else name,
                                              {})
        value = scored["variants"][name]["map50"]
        variants[name] = {"map50": value["value"], "ci95": value.get("ci95"), "layers": row.get("layers"),
                          **speeds.get(name, {}), "throughput_in_pipeline": row.get("throughput")}
    if "qat-auto" in extra:
        from qatpipe.stages.retrain import AUTO_FILE, AUTO_FOLDER

        variants["qat-auto"]["excluded_layers_auto"] = read_json(
            extra["qat-auto"] / "retrain" / AUTO_FOLDER / AUTO_FILE)
        layers = read_json(extra["qat-auto"] / "engine" / "engine.json").get("layer_precision")  # as validate reads
        variants["qat-auto"]["layers"] = f"{layers['int8']} / {layers['fp16']} / {layers['fp32']}" if layers else None
    return {"backbone": backbone, "overrides": sets, "variants": variants,
            "pairs": {key: pair["map50"] for key, pair in scored["pairs"].items()},
            "val_images": scored["images"],
            "ptq_partial": {key: partial.get(key) for key in ("float_layers", "layers_total", "budget_met", "map50",
                                                              "map50_fp32", "map50_int8", "val_images", "steps")},
            "wall_seconds": wall, "extra_qat_seconds": seconds}


def engine_speeds(engines: dict[str, Path], size, batch_size: int = 8, rounds: int = 5) -> dict[str, dict]:
    """The engines (variant -> folder: the run's, as its validate tasks scored them, and this script's extra
    QAT retrains') timed here on random images of `size` (dataset.image_size) at `batch_size`, every engine
    once a round for `rounds` rounds, in this one process: variant -> img/s (the rounds' median), its speed-up
    over FP32 and that speed-up's range over the rounds. The pipeline's own build-engine figures come from tasks run minutes to hours apart, each under
    whatever else the machine ran."""
    import numpy as np

    from qatpipe.engines import load_engine

    runners = {variant: load_engine(folder).run for variant, folder in engines.items()}
    batch = np.random.default_rng(0).uniform(size=(batch_size, size.height, size.width, 3)).astype(np.float32)
    timed = {name: per[batch_size] for name, per in
             time_in_rounds(runners, {batch_size: batch}, rounds, 50, 10.0, log).items()}
    medians = {name: median_round(t) for name, t in timed.items()}
    return {name: {"throughput": medians[name]["throughput"],
                   "speedup_vs_fp32": round(medians["fp32"]["latency_ms_p50"] / medians[name]["latency_ms_p50"], 2),
                   "speedup_range": speedup_range(timed["fp32"], t)} for name, t in timed.items()}


def print_report(rows: list[dict]) -> None:
    for row in rows:
        partial = row["ptq_partial"]
        extra = ", ".join(f"{name} {sec} s" for name, sec in extra_seconds(row).items())
        print(f"\n{row['backbone']}: whole pipeline {row['wall_seconds']} s, {extra or 'no extra QAT retrain'}; "
              f"ptq-partial kept {len(partial['float_layers'] or [])} of "
              f"{partial['layers_total']} layers float "
              f"({', '.join(partial['float_layers'] or []) or 'none'}), budget "
              f"{'met' if partial['budget_met'] else 'NOT met'} on its {partial['val_images']} val images "
              f"({partial['map50']:.4f} against FP32 {partial['map50_fp32']:.4f}, all INT8 "
              f"{partial['map50_int8']:.4f})")
        print("variant      mAP@0.5  95% CI             - FP32 (points)         - PTQ (points)          "
              "layers INT8/FP16/FP32  img/s@8  speed-up (range over rounds)")
        for name, v in row["variants"].items():
            cells = []
            for other in ("fp32", "ptq"):
                pair = row["pairs"].get(f"{name}-{other}")
                cells.append(f"{100 * pair['diff']:+6.2f} {ci_text(pair['ci95'], 100, '+')}" if pair else "")
            spread = v.get("speedup_range")  # older rows quote the pipeline's figures, without one
            speed = (f"{v['throughput']:7.1f}  {v['speedup_vs_fp32']:.2f}x"
                     + (f" ({spread[0]:.2f}-{spread[1]:.2f})" if spread else "") if v.get("throughput") else
                     "(QAT's graph)" if name in QAT_GRAPH else "(FP32's graph)" if name == FP32_LONGER else "n/a")
            print(f"{name:<12} {v['map50']:.4f}   {ci_text(v['ci95']):<18} {cells[0]:<23} {cells[1]:<23} "
                  f"{str(v['layers'] or ''):<22} {speed}")
        if auto := row["variants"].get("qat-auto", {}).get("excluded_layers_auto"):
            print(f"qat-auto kept float: {', '.join(auto['excluded_layers']) or 'none'} (partial PTQ of the FP32 "
                  f"start: {auto['map50_subset']:.4f} with them float, {auto['map50_subset_int8']:.4f} all INT8, FP32 "
                  f"{auto['map50_subset_fp32']:.4f}; budget {'met' if auto['budget_met'] else 'NOT met'})")
        for name in row["variants"]:
            if pair := row["pairs"].get(f"{name}-qat"):
                print(f"{name} - qat: {100 * pair['diff']:+.2f} points {ci_text(pair['ci95'], 100, '+')} (paired over "
                      "the val images; the spread between training runs is not in it)")
            if pair := row["pairs"].get(f"{name}-{FP32_LONGER}"):
                print(f"{name} - {FP32_LONGER}: {100 * pair['diff']:+.2f} points {ci_text(pair['ci95'], 100, '+')} "
                      "(against FP32 trained as long)")
        qat = row["pairs"].get("qat-fp32")
        if qat:
            print(f"QAT - FP32 CI half-width: {50 * (qat['ci95'][1] - qat['ci95'][0]):.2f} points "
                  f"({row['val_images']} val images)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path("results/bench_qat_value"))
    parser.add_argument("--backbones", nargs="+", default=["mobilenet_v2", "resnet", "efficientnet_b0"])
    parser.add_argument("--distill-weight", type=float, default=1.0,
                        help="the qat+distill variant's qat.distill_weight; 0: no such variant")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--qat-auto", action="store_true",
                        help="also the variant qat-auto: the QAT retrain again with qat.excluded_layers auto")
    parser.add_argument("--qat-freeze", type=int, metavar="N",
                        help="also the variant qat-freeze: the QAT retrain again with BatchNormalization statistics "
                             "and activation ranges frozen after N epochs (qat.bn_update_epochs, range_update_epochs)")
    parser.add_argument("--qat-start", choices=STARTS,
                        help="also the variant qat-START: QAT again from where qat.start START begins it, as long as "
                             "that order trains it")
    parser.add_argument("--fp32-longer", action="store_true",
                        help="also the variant fp32-longer: the FP32 baseline fine-tuned again as qat.start baseline's "
                             "QAT fine-tunes it, in FP32 (that order's control)")
    parser.add_argument("--no-pipeline", action="store_true",
                        help="run no pipeline: take WORK's finished runs as they are, run the extra QAT retrains "
                             "they lack, score and time them all again")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    os.environ.pop("MLFLOW_TRACKING_URI", None)  # each run's local SQLite store
    args.work.mkdir(parents=True, exist_ok=True)
    out = args.work / "bench_qat_value.json"
    before = {row["backbone"]: row for row in read_json(out).get("rows", [])}
    rows = [row for name, row in before.items() if name not in args.backbones]
    for backbone in args.backbones:
        rows.append(run_backbone(backbone, args.work, args.overrides, args.distill_weight, args.qat_auto,
                                 before.get(backbone, {}) if args.no_pipeline else None, args.qat_freeze,
                                 args.qat_start, args.fp32_longer))
        out.write_text(json.dumps({"distill_weight": args.distill_weight, "rows": rows}, indent=2))
        print_report(rows[-1:])
    print_report(rows)


if __name__ == "__main__":
    main()
