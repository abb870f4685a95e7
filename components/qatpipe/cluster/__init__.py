"""Multi-node training on Kubernetes: MPIJob manifests for Horovod (mpijob.py) and running them (launcher.py, with
kube_client.py for the API and job_log.py to follow a job)."""

from qatpipe.cluster.mpijob import (
    MpiJobRequest,
    PvcMount,
    Resources,
    job_name,
    mpijob_manifest,
    validate_manifest,
)

__all__ = ["MpiJobRequest", "PvcMount", "Resources", "job_name", "mpijob_manifest", "validate_manifest"]
