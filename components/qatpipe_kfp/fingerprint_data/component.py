"""fingerprint-data: the digest of the spec's data as it is now (S3 listing with ETags, or the local files'
bytes), so prepare-data's cache key follows the data, not only the spec's URIs."""

from qatpipe_kfp.settings import component


@component
def fingerprint_data(data_spec: str) -> str:
    """Digest the spec's data as it is now, so that prepare-data's cache key follows the data, not only its URIs.

    Args:
        data_spec: The spec's data view (section dataset), as YAML.

    Returns:
        Output: 16 hex digits of SHA-256 over the S3 listing (keys, sizes, ETags) or the local files (paths, sizes,
            bytes) of dataset.train and dataset.val; "synthetic" when the spec names no data.
    """
    from qatpipe.data.prepare import data_fingerprint
    from qatpipe_kfp.runtime import load_stage_spec, log, stage

    with stage("fingerprint-data"):
        fingerprint = data_fingerprint(load_stage_spec(data_spec))
        log.info("data fingerprint: %s", fingerprint)
        return fingerprint
