"""Stage: prune a trained detector (TAO `prune`): a physically smaller model plus a report."""

from __future__ import annotations

import logging
from pathlib import Path

from qatpipe.fileio import atomic_write_text, save_keras_model, write_json
from qatpipe.spec import PruneSpec
from qatpipe.tracking.records import REPORT_MARKDOWN, StageRecord

log = logging.getLogger(__name__)

MODEL_FILE = "model.keras"
REPORT_FILE = "prune_report.json"
# the figures of a pruning worth a metric (the stage record's, and the KFP task's)
TRACKED = ("params_before", "params_after", "flops_before", "flops_after", "flops_ratio", "params_ratio",
           "threshold_used")


def prune(model_path: str | Path, output: str | Path, settings: PruneSpec, arch=None) -> dict:
    """Prune `model_path` by `settings`. `output` is a folder (model.keras, prune_report.json, report.md,
    tracking.json go in it) or a `.keras` file (the report goes beside it as <stem>_prune_report.json, with no
    report.md)."""
    from qatpipe.models.io import load_keras_model
    from qatpipe.pruning import prune_model

    output = Path(output)
    if output.suffix == ".keras":
        folder, model_file, report_file = output.parent, output, output.with_name(f"{output.stem}_{REPORT_FILE}")
    else:
        folder, model_file, report_file = output, output / MODEL_FILE, output / REPORT_FILE
    folder.mkdir(parents=True, exist_ok=True)
    model = load_keras_model(model_path, arch)
    pruned, report = prune_model(model, settings)
    save_keras_model(pruned, model_file)
    result = {"model": str(model_file), "source": str(model_path), **report.to_dict(),
              "threshold_used": report.settings["threshold_used"]}
    write_json(report_file, result)
    artifacts = [model_file.name, report_file.name]
    if output.suffix != ".keras":  # a report.md beside a lone .keras file could overwrite another one
        atomic_write_text(folder / REPORT_MARKDOWN, markdown(result))
        artifacts.append(REPORT_MARKDOWN)
    StageRecord(stage="prune", params={f"prune.{k}": v for k, v in settings.model_dump().items()},
                metrics={k: result[k] for k in TRACKED}, artifacts=artifacts).write(folder)
    log.info("pruned model: %s (FLOPs x%.3f, params x%.3f); report: %s", model_file, result["flops_ratio"],
             result["params_ratio"], report_file)
    return result


def markdown(result: dict) -> str:
    """The pruning as Markdown: totals, the threshold, and each channel set's filters before and after."""
    rows = [f"| {', '.join(g['convs'])} | {g['before']} | {g['after']} |" for g in result["groups"]]
    return "\n".join([
        f"# Pruning: FLOPs x{result['flops_ratio']:.3f}, params x{result['params_ratio']:.3f}", "",
        f"{result['params_before']:,} → {result['params_after']:,} parameters, "
        f"{result['flops_before'] / 1e9:.3f} → {result['flops_after'] / 1e9:.3f} GFLOPs; channels whose "
        f"normalised norm is below {result['threshold_used']:.4f} removed", "",
        "| convs (one channel set) | filters before | after |", "|---|---|---|", *rows, ""])


__all__ = ["prune", "markdown", "MODEL_FILE", "REPORT_FILE", "TRACKED"]
