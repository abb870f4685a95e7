"""Stage: retrain a pruned detector (TAO `train` with `pruned_model_path`): FP32 fine-tuning that recovers the
accuracy pruning took. Same training loop, schedule, checkpoints and resume as `train`; the model comes from
the pruned file instead of a fresh initialisation."""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

from qatpipe.errors import QatpipeError
from qatpipe.fileio import write_json
from qatpipe.spec import ExperimentSpec

log = logging.getLogger(__name__)

SOURCE_FILE = "source_model.json"


def retrain(spec: ExperimentSpec, pruned_model_path: str | Path, results_dir: str | Path,
            use_amp: bool | None = None, stage_name: str = "retrain_fp32") -> dict:
    """Fine-tune the pruned model into `results_dir` (model.keras, checkpoints, logs, tracking.json)."""
    from qatpipe.models import get_architecture
    from qatpipe.models.io import load_keras_model
    from qatpipe.stages.train import train

    pruned_model_path = Path(pruned_model_path)
    results_dir = Path(results_dir)
    model = load_keras_model(pruned_model_path, get_architecture(spec))
    _claim(results_dir, pruned_model_path)
    log.info("retraining %s (%d params)", pruned_model_path, model.count_params())
    summary = train(spec, results_dir, use_amp=use_amp, model=model, stage_name=stage_name)
    summary["source_model"] = str(pruned_model_path)
    return summary


def _claim(results_dir: Path, source: Path) -> None:
    """Checkpoints in `results_dir` belong to one pruned model: refuse to resume them onto another."""
    digest = hashlib.sha256(source.read_bytes()).hexdigest()
    marker = results_dir / SOURCE_FILE
    if marker.is_file():
        previous = json.loads(marker.read_text())
        if previous.get("sha256") != digest:
            raise QatpipeError(
                f"{results_dir}: holds a retraining of another pruned model ({previous.get('path')}); use a new "
                f"results directory for {source}"
            )
        return
    results_dir.mkdir(parents=True, exist_ok=True)
    write_json(marker, {"path": str(source), "sha256": digest})


__all__ = ["retrain"]
