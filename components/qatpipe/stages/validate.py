"""Stage: validate a deployable engine: its mAP on the val set, by running it, against the FP32 baseline, and
the gate `validate.max_map_drop` (TAO's last check before a model ships)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from qatpipe.errors import QatpipeError
from qatpipe.fileio import atomic_write_text, write_json
from qatpipe.spec import ExperimentSpec
from qatpipe.tracking.records import StageRecord

log = logging.getLogger(__name__)

REPORT_FILE = "validation.json"
MARKDOWN_FILE = "validation.md"


class GateFailed(QatpipeError):
    """The engine lost more mAP@0.5 than validate.max_map_drop allows."""


def read_baseline(path: str | Path) -> dict:
    path = Path(path)
    try:
        baseline = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise QatpipeError(f"{path}: cannot read the baseline metrics: {exc}") from None
    if not isinstance(baseline, dict) or "map50" not in baseline:
        raise QatpipeError(f"{path}: not an evaluation metrics.json (no map50)")
    return baseline


def gate(map50: float, baseline_map50: float, max_drop: float) -> tuple[bool, float]:
    """(passed, drop): the drop is baseline - engine in mAP@0.5 (negative: the engine is better)."""
    drop = round(baseline_map50 - map50, 6)
    return drop <= max_drop + 1e-12, drop


def validate(spec: ExperimentSpec, engine_dir: str | Path, baseline_metrics: str | Path,
             output_dir: str | Path | None = None, variant: str = "int8", bench: dict | None = None) -> dict:
    """Evaluate the engine, compare with the baseline, write validation.json / .md; never raises on a failed
    gate (the result says `passed`: the caller decides, the CLI exits non-zero)."""
    from qatpipe.stages.evaluate import evaluate

    engine_dir = Path(engine_dir)
    baseline = read_baseline(baseline_metrics)
    output_dir = Path(output_dir) if output_dir else engine_dir / "validate"
    evaluation = evaluate(spec, engine_dir, output_dir, stage_name=f"validate_{variant}")
    passed, drop = gate(evaluation["map50"], baseline["map50"], spec.validate_.max_map_drop)
    report = {
        "variant": variant, "engine": str(engine_dir), "map50": evaluation["map50"], "map": evaluation["map"],
        "baseline": str(baseline_metrics), "baseline_map50": baseline["map50"], "baseline_map": baseline.get("map"),
        "map50_drop": drop, "max_map_drop": spec.validate_.max_map_drop, "passed": passed,
        "engine_size_mb": evaluation["model_size_mb"],
    }
    if bench:
        report["benchmark"] = bench
    write_json(output_dir / REPORT_FILE, report)
    verdict = "PASSED" if passed else "FAILED"
    atomic_write_text(output_dir / MARKDOWN_FILE, "\n".join([
        f"# Validation of {variant}: {verdict}", "",
        "| | mAP@0.5 | mAP@[.5:.95] |", "|---|---|---|",
        f"| {variant} (engine) | {evaluation['map50']:.4f} | {evaluation['map']:.4f} |",
        f"| baseline | {baseline['map50']:.4f} | {baseline.get('map', float('nan')):.4f} |", "",
        f"mAP@0.5 drop {100 * drop:+.2f} points; allowed {100 * spec.validate_.max_map_drop:.2f} "
        f"(validate.max_map_drop).", ""]))
    record = StageRecord.read(output_dir)
    record.metrics.update({"map50_drop": drop, "passed": float(passed)})
    record.artifacts.extend([REPORT_FILE, MARKDOWN_FILE])
    record.write(output_dir)
    log.info("validation of %s: %s (mAP@0.5 %.4f vs baseline %.4f, drop %+.2f points, allowed %.2f)", variant,
             verdict, evaluation["map50"], baseline["map50"], 100 * drop, 100 * spec.validate_.max_map_drop)
    return report


def gate_message(report: dict) -> str:
    return (f"validation gate failed for {report['variant']}: mAP@0.5 {report['map50']:.4f} is "
            f"{100 * report['map50_drop']:.2f} points below the baseline {report['baseline_map50']:.4f}, more than "
            f"validate.max_map_drop={report['max_map_drop']} ({100 * report['max_map_drop']:.2f} points) allows")


__all__ = ["validate", "gate", "gate_message", "GateFailed", "read_baseline"]
