"""What the bench scripts read from a finished `qatpipe run --local` folder."""

import json
from pathlib import Path


def evaluation_folders(kfp_root: Path) -> dict[str, Path]:
    """The evaluation folders of the unpruned model ("unpruned") and of the retrained FP32 model ("fp32") under
    a run's kfp/ folder, whichever are there. kfp.local names task folders by task id, so an evaluation is told
    apart by the task that made the model it scored: train, or the export whose report says no QAT."""
    from qatpipe.export.bundle import ExportBundle

    found = {}
    for metrics_path in kfp_root.rglob("metrics.json"):
        model = json.loads(metrics_path.read_text()).get("model")
        if not model:
            continue
        task = Path(model).parent.parent
        if task.name == "train":
            found["unpruned"] = metrics_path.parent
        elif task.name.startswith("export") and "QAT" not in ExportBundle(Path(model)).report.read_text():
            found["fp32"] = metrics_path.parent
    return found


def stage_folders(kfp_root: Path, *stages: str) -> list[Path]:
    """The task folders under a run's kfp/ whose tracking record is one of `stages`' (evaluate_fp32,
    retrain_qat, ...), in path order."""
    return [p.parent for p in sorted(kfp_root.rglob("tracking.json")) if json.loads(p.read_text())["stage"] in stages]


def stage_folder(run: Path, *stages: str) -> Path:
    """The first task folder of a `qatpipe run --local` folder whose record is one of `stages`'; exits naming the
    run when there is none."""
    found = stage_folders(run / "kfp", *stages)
    if not found:
        raise SystemExit(f"{run}: no finished {' or '.join(stages)}")
    return found[0]

