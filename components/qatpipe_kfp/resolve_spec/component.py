"""resolve-spec: check the credentials Secret (qatpipe.cluster.credentials), read the spec (bundled name, file in
the image, or s3://), apply overrides, validate, and hand each stage the sections it reads
(qatpipe.spec.STAGE_SECTIONS)."""

from typing import List, NamedTuple

from qatpipe_kfp.settings import component


# The return type is spelled out in the signature: KFP ships only the function's source to the pod.
@component
def resolve_spec(spec_uri: str, overrides: List[str], credentials_secret: str = "") -> NamedTuple(
        "StageSpecs", [("spec", str), ("data_spec", str), ("train_spec", str), ("evaluate_spec", str),
                       ("prune_spec", str), ("retrain_spec", str), ("retrain_qat_spec", str),
                       ("export_spec", str), ("ptq_spec", str), ("engine_spec", str), ("validate_spec", str),
                       ("registry_name", str)]):
    """Check the credentials Secret, read and validate the spec, and give each stage the spec sections it reads.

    Args:
        spec_uri: A bundled spec name, a path inside the image, or s3://bucket/key.
        overrides: KEY=VALUE overrides, applied to the spec before it is validated.
        credentials_secret: The Kubernetes Secret with the S3 / MLflow credentials, checked first: when named it
            must exist in the pods' namespace and hold the S3 keys that s3:// spec or data URIs need. Empty: only
            the environment is checked.

    Returns:
        spec: The full resolved spec, as YAML.
        data_spec: The data view (section dataset), for fingerprint-data and prepare-data, as YAML.
        train_spec: The train view (sections dataset, model, augmentation, train, evaluate), as YAML.
        evaluate_spec: The evaluate view (sections dataset, model, evaluate), as YAML.
        prune_spec: The prune view (sections dataset, model, prune), as YAML.
        retrain_spec: The FP32 retrain view (sections dataset, model, augmentation, train, evaluate, retrain), as
            YAML.
        retrain_qat_spec: The QAT retrain view (sections dataset, model, augmentation, train, evaluate, retrain,
            qat), as YAML.
        export_spec: The export view (sections dataset, model, export), as YAML.
        ptq_spec: The ptq view (sections dataset, model, evaluate, ptq), as YAML.
        engine_spec: The engine view (sections dataset, model, engine), as YAML.
        validate_spec: The validate view (sections dataset, model, evaluate, engine, validate), as YAML.
        registry_name: The name of the MLflow registered model (tracking.registered_model).
    """
    from collections import namedtuple

    from qatpipe.cluster.credentials import check_credentials, check_tracking_access
    from qatpipe.spec import STAGE_SECTIONS, spec_output_name, spec_to_yaml, stage_view
    from qatpipe.spec_sources import load_spec_uri
    from qatpipe_kfp.runtime import stage

    with stage("resolve-spec"):
        # the run's first task: a missing credentials Secret or key fails here, in one line
        check_credentials(credentials_secret, [spec_uri])
        spec = load_spec_uri(spec_uri, list(overrides))
        check_credentials(credentials_secret, [spec.dataset.train or "", spec.dataset.val or ""])
        check_tracking_access(credentials_secret)
        outputs = namedtuple("StageSpecs", ["spec", *map(spec_output_name, STAGE_SECTIONS), "registry_name"])
        return outputs(spec_to_yaml(spec), *(stage_view(spec, view) for view in STAGE_SECTIONS),
                       spec.tracking.registered_model)
