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
        pruned: Folder with model.keras, prune_report.json and tracking.json; its metadata holds the parameter count.
        metrics: The parameters and FLOPs before and after pruning, and their ratios.
        report: The filters of each channel set before and after pruning, as Markdown.
    """
    from pathlib import Path

    from qatpipe.models import get_architecture
    from qatpipe.stages.prune import prune as prune_stage
    from qatpipe_kfp.runtime import load_stage_spec, stage, write_metrics, write_text

    with stage("prune"):
        spec = load_stage_spec(prune_spec)
        model_file = Path(model.path) / model.metadata.get("file", "model.keras")
        result = prune_stage(model_file, pruned.path, spec.prune, get_architecture(spec))
        pruned.metadata.update({"framework": "tf_keras", "file": "model.keras", "params": result["params_after"]})
        figures = {key: result[key] for key in ("params_before", "params_after", "flops_before", "flops_after",
                                                 "flops_ratio", "params_ratio", "threshold_used")}
        write_metrics(metrics, figures)
        rows = [f"| {', '.join(g['convs'])} | {g['before']} | {g['after']} |" for g in result["groups"]]
        write_text(report, "\n".join([
            f"# Pruning: FLOPs x{result['flops_ratio']:.3f}, params x{result['params_ratio']:.3f}", "",
            f"{result['params_before']:,} → {result['params_after']:,} parameters, "
            f"{result['flops_before'] / 1e9:.3f} → {result['flops_after'] / 1e9:.3f} GFLOPs; channels whose "
            f"normalised norm is below {result['threshold_used']:.4f} removed", "",
            "| convs (one channel set) | filters before | after |", "|---|---|---|", *rows, ""]))
