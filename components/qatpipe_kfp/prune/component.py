"""prune: TAO-style structured pruning of the trained detector (a physically smaller model + report)."""

from kfp.dsl import Input, Markdown, Metrics, Model, Output

from qatpipe_kfp.settings import component


@component
def prune(prune_spec: str, model: Input[Model], pruned: Output[Model], metrics: Output[Metrics],
          report: Output[Markdown]):
    """Prune the trained detector TAO-style (structured, whole filters) into a physically smaller model.

    Args:
        prune_spec: The spec's prune view (sections dataset, model, prune), as YAML.
        model: The trained model folder (train's `model`); the file is its `file` metadata (default model.keras).

    Returns:
        pruned: Folder with model.keras, prune_report.json, report.md and tracking.json; its metadata holds the
            parameter count.
        metrics: The parameters and FLOPs before and after pruning, and their ratios.
        report: The filters of each channel set before and after pruning, as Markdown.
    """
    from pathlib import Path

    from qatpipe.models import get_architecture
    from qatpipe.stages.prune import TRACKED, prune as prune_stage
    from qatpipe.tracking.records import REPORT_MARKDOWN
    from qatpipe_kfp.runtime import load_stage_spec, stage, write_metrics, write_text

    with stage("prune", record=pruned):
        spec = load_stage_spec(prune_spec)
        model_file = Path(model.path) / model.metadata.get("file", "model.keras")
        result = prune_stage(model_file, pruned.path, spec.prune, get_architecture(spec))
        pruned.metadata.update({"framework": "tf_keras", "file": "model.keras", "params": result["params_after"]})
        write_metrics(metrics, {key: result[key] for key in TRACKED})
        write_text(report, (Path(pruned.path) / REPORT_MARKDOWN).read_text())
