"""fingerprint-data: the digest of the spec's data as it is now (S3 listing with ETags, or the local files'
bytes), so prepare-data's cache key follows the data, not only the spec's URIs."""

from qatpipe_kfp.settings import component


@component
def fingerprint_data(data_spec: str) -> str:
    from qatpipe.data.prepare import data_fingerprint
    from qatpipe_kfp.runtime import load_stage_spec, log, stage

    with stage("fingerprint-data"):
        fingerprint = data_fingerprint(load_stage_spec(data_spec))
        log.info("data fingerprint: %s", fingerprint)
        return fingerprint
