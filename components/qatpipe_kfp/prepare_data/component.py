"""prepare-data: generate the synthetic data set, or fetch (s3://) and validate the spec's KITTI folders."""

from kfp.dsl import Dataset, Markdown, Output

from qatpipe_kfp.settings import component


@component
def prepare_data(data_spec: str, dataset: Output[Dataset], report: Output[Markdown], data_fingerprint: str = ""):
    """Generate the synthetic data set, or fetch (s3://) and validate the KITTI folders the spec names.

    Args:
        data_spec: The spec's data view (section dataset), as YAML.
        data_fingerprint: fingerprint-data's digest of the data. Only recorded in the data set's metadata; as an
            input it keys the KFP cache, so changed files under the same URIs are prepared again.

    Returns:
        dataset: Folder with dataset.json (source, split locations, classes, per-class counts, digests),
            report.md and tracking.json; a synthetic data set's images are generated into it. Its metadata
            holds the source, the image count of each split and the fingerprint.
        report: The per-class object counts of both splits, as Markdown.
    """
    # data_fingerprint (fingerprint-data's output) is here for the cache key: changed data, another key
    from pathlib import Path

    from qatpipe.stages.prepare_data import prepare_data as prepare_stage
    from qatpipe.tracking.records import REPORT_MARKDOWN
    from qatpipe_kfp.runtime import load_stage_spec, stage, write_text

    with stage("prepare-data", record=dataset):
        manifest = prepare_stage(load_stage_spec(data_spec), dataset.path)
        counts = manifest["counts"]
        dataset.metadata.update({"source": manifest["source"], "train_images": counts["train"]["images"],
                                 "val_images": counts["val"]["images"], "fingerprint": data_fingerprint})
        write_text(report, (Path(dataset.path) / REPORT_MARKDOWN).read_text())
