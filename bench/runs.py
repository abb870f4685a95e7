"""What the bench scripts read from a finished `qatpipe run --local` folder."""

import json
from pathlib import Path


def evaluation_folders(kfp_root: Path) -> dict[str, Path]:
    """The evaluation folders of the unpruned model ("unpruned") and of the retrained FP32 model ("fp32") under
    a run's kfp/ folder, whichever are there. kfp.local names task folders by task id, so an evaluation is told
    apart by the task that made the model it scored: train, or the export whose report says no QAT."""
    found = {}
    for metrics_path in kfp_root.rglob("metrics.json"):
        model = json.loads(metrics_path.read_text()).get("model")
        if not model:
            continue
        task = Path(model).parent.parent
        if task.name == "train":
            found["unpruned"] = metrics_path.parent
        elif task.name.startswith("export") and "QAT" not in (task / "onnx_model" / "model_export.json").read_text():
            found["fp32"] = metrics_path.parent
    return found
