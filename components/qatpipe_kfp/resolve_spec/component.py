"""resolve-spec: check the credentials Secret (qatpipe.cluster.credentials), read the spec (bundled name, file in
the image, or s3://), apply overrides, validate, and hand each stage the sections it reads: an output per view of
qatpipe.spec.STAGE_SECTIONS, the one table (outputs and their descriptions follow it, qatpipe_kfp.runtime.SpecViews)."""

from typing import List

from qatpipe_kfp.runtime import spec_views_doc
from qatpipe_kfp.settings import component


# KFP ships only the function's source to the pod, where the return annotation is evaluated again: it imports the
# type by name rather than spelling out one output per view.
def resolve_spec(spec_uri: str, overrides: List[str], credentials_secret: str = "", train_data: str = "",
                 val_data: str = "") -> __import__("qatpipe_kfp.runtime", fromlist=["SpecViews"]).SpecViews:
    """Check the credentials Secret, read and validate the spec, and give each stage the spec sections it reads.

    Args:
        spec_uri: A bundled spec name, a path inside the image, or s3://bucket/key.
        overrides: KEY=VALUE overrides, applied to the spec before it is validated.
        credentials_secret: The Kubernetes Secret with the S3 / MLflow credentials, checked first: when named it
            must exist in the pods' namespace and hold the S3 keys that s3:// spec or data URIs need. Empty: only
            the environment is checked.
        train_data: The training data (a KITTI folder: local path in the image or s3://bucket/prefix), in place of
            the spec's dataset.train and after the overrides. Empty: the spec's.
        val_data: The validation data, likewise in place of dataset.val. Empty: the spec's.
    """
    import json

    from qatpipe.cluster.credentials import check_credentials, check_tracking_access
    from qatpipe.spec import STAGE_SECTIONS, spec_to_yaml, stage_view
    from qatpipe.spec_sources import load_spec_uri
    from qatpipe_kfp.runtime import SpecViews, stage

    with stage("resolve-spec"):
        # the run's first task: a missing credentials Secret or key fails here, in one line
        check_credentials(credentials_secret, [spec_uri])
        # the data parameters win over the spec and its overrides; JSON-quoted, so a path stays a string
        data = [f"dataset.{key}={json.dumps(value)}" for key, value in (("train", train_data), ("val", val_data))
                if value]
        spec = load_spec_uri(spec_uri, [*overrides, *data])
        check_credentials(credentials_secret, [spec.dataset.train or "", spec.dataset.val or ""])
        check_tracking_access(credentials_secret)
        return SpecViews(spec_to_yaml(spec), *(stage_view(spec, view) for view in STAGE_SECTIONS),
                         spec.tracking.registered_model)


resolve_spec.__doc__ += spec_views_doc()
resolve_spec = component(resolve_spec)
