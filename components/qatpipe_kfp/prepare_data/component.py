"""prepare-data: generate the synthetic data set, or fetch (s3://) and validate the spec's KITTI folders."""

from kfp.dsl import Dataset, Markdown, Output

from qatpipe_kfp.settings import component


@component
def prepare_data(data_spec: str, dataset: Output[Dataset], report: Output[Markdown], data_fingerprint: str = ""):
    """Generate the synthetic data set, or fetch (s3://) and validate the KITTI folders the spec names.

    Args:
        data_spec: The spec's prepare_data view (section dataset), as YAML.
        data_fingerprint: fingerprint-data's digest of the data. Only recorded in the data set's metadata; as an
            input it keys the KFP cache, so changed files under the same URIs are prepared again.

    Returns:
        dataset: Folder with dataset.json (source, split locations, classes, per-class counts, digests) and
            tracking.json; a synthetic data set's images are generated into it. Its metadata holds the source,
            the image count of each split and the fingerprint.
        report: The per-class object counts of both splits, as Markdown.
    """
    # data_fingerprint (fingerprint-data's output) is here for the cache key: changed data, another key
    from qatpipe.data.prepare import prepare_dataset
    from qatpipe.tracking.records import StageRecord, numeric_leaves
    from qatpipe_kfp.runtime import load_stage_spec, stage, write_text

    with stage("prepare-data"):
        spec = load_stage_spec(data_spec)
        manifest = prepare_dataset(spec, dataset.path)
        counts = manifest["counts"]
        dataset.metadata.update({"source": manifest["source"], "train_images": counts["train"]["images"],
                                 "val_images": counts["val"]["images"], "fingerprint": data_fingerprint})
        rows = [f"| {name} | {counts['train']['objects'][name]} | {counts['val']['objects'][name]} |"
                for name in manifest["classes"]]
        write_text(report, "\n".join([
            f"# Data set ({manifest['source']})", "",
            f"train: `{manifest['train']}` ({counts['train']['images']} images), "
            f"val: `{manifest['val']}` ({counts['val']['images']} images)", "",
            "| class | train objects | val objects |", "|---|---|---|", *rows, ""]))
        StageRecord(stage="prepare_data", params={"source": manifest["source"], "train": manifest["train"],
                                                  "val": manifest["val"]},
                    metrics=numeric_leaves(counts), artifacts=["dataset.json"]).write(dataset.path)
