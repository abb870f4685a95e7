"""Benchmark: the Jetson DLA export (issue "TensorRT 11 and Jetson", item 3). For each finished run's QAT model:
the DLA form's layer placement (what runs on DLA, what falls back to the GPU) and its accuracy with INT8 on every
tensor (the full-tensor calibration cache DLA needs), against the QAT model's own Q/DQ form, both in ONNX
Runtime's exact CPU form, with the paired bootstrap's 95% CI over the val images.

    python bench/dla.py --run WORK/resnet [--run ...] [--work DIR] [--methods percentile minmax]

A run is a `qatpipe run --local` work folder. Its QAT retrain's model is exported afresh with
`export.target: dla` into DIR/<run>/<method>/ (the export stage's own code, each calibration method of the
tensors without a QAT scale in turn), then scored by validate's
`dla_emulated_map50` and, for the Q/DQ form, by an exact-form ONNX Runtime engine. No Jetson or TensorRT here:
what DLA's hardware does beyond INT8 rounding on every tensor is not measured. Writes DIR/bench_dla.json.
"""

import argparse
import json
import logging
import shutil
from pathlib import Path

log = logging.getLogger("bench")


def bench_run(run: Path, work: Path, method: str) -> dict:
    from qatpipe_pipelines.run_folder import RunFolder

    from qatpipe.export.bundle import ExportBundle
    from qatpipe.spec import load_spec
    from qatpipe.stages.compare import uncertainty
    from qatpipe.stages.export import export
    from qatpipe.stages.validate import DLA_EMULATED_FOLDER, dla_emulated_map50, exact_form_map50

    spec_path = RunFolder(run).stage("retrain_qat") / "spec.yaml"  # its model.keras beside it
    spec = load_spec(spec_path)
    spec.export.target, spec.export.fp16_onnx, spec.export.dla_calibration_method = "dla", False, method
    folder = work / run.name / method
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    report = export(spec, spec_path.with_name("model.keras"), folder / "model.onnx")["dla"]
    qdq = exact_form_map50(spec, folder / "model.onnx", folder / "qdq", "qdq")
    dla, _ = dla_emulated_map50(spec, folder / "model.onnx", folder)
    pair = uncertainty({"qdq": folder / "qdq", "dla": folder / DLA_EMULATED_FOLDER},
                       pairs=[("dla", "qdq")])["pairs"]["dla-qdq"]["map50"]
    row = {"run": str(run), "backbone": spec.model.backbone.name, "method": method, "map50_qdq": qdq,
           "map50_dla_emulated": dla,
           "diff": pair["diff"], "ci95": pair["ci95"],
           **{key: report[key] for key in ("on_dla", "on_gpu", "scales", "qat_scales", "calibrated_scales",
                                           "scales_raised_to_equal_ranges")}}
    placement = json.loads(ExportBundle(folder / "model.onnx").dla_report.read_text())["placement"]
    row["gpu_layers"] = sorted({f"{p['op']} ({p['rule']})" for p in placement if p["device"] == "GPU"})
    log.info("%s (%s): Q/DQ %.4f, DLA INT8 everywhere %.4f (%+.2f points)", run.name, method, qdq, dla,
             100 * pair["diff"])
    return row


def print_rows(rows: list[dict]) -> None:
    print("\nDLA forms (mAP@0.5 in ONNX Runtime's exact CPU form; DLA - Q/DQ in points with the paired bootstrap's "
          "95% CI)\n")
    print("| run | backbone | calibration | QAT Q/DQ | DLA, INT8 on every tensor | DLA - Q/DQ | layers DLA / GPU | "
          "scales (QAT / calibrated / raised) | GPU layers |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        lo, hi = (100 * v for v in r["ci95"])
        print(f"| {Path(r['run']).name} | {r['backbone']} | {r['method']} | {r['map50_qdq']:.4f} | "
              f"{r['map50_dla_emulated']:.4f} | "
              f"{100 * r['diff']:+.2f} [{lo:+.2f}, {hi:+.2f}] | {r['on_dla']} / {r['on_gpu']} | {r['qat_scales']} / "
              f"{r['calibrated_scales']} / {r['scales_raised_to_equal_ranges']} | {', '.join(r['gpu_layers'])} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", type=Path, action="append", required=True, help="a finished run's work folder")
    parser.add_argument("--work", type=Path, default=Path("results/bench_dla"))
    parser.add_argument("--methods", nargs="+", default=["percentile", "minmax"],
                        help="calibration methods of the tensors without a QAT scale (export.dla_calibration_method)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    rows = [bench_run(run, args.work, method) for run in args.run for method in args.methods]
    args.work.mkdir(parents=True, exist_ok=True)
    (args.work / "bench_dla.json").write_text(json.dumps(rows, indent=2) + "\n")
    print_rows(rows)


if __name__ == "__main__":
    main()
