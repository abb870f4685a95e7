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
    from collections import namedtuple

    from qatpipe.cluster.credentials import check_credentials
    from qatpipe.spec import spec_to_yaml, stage_view
    from qatpipe.spec_sources import load_spec_uri
    from qatpipe_kfp.runtime import stage

    with stage("resolve-spec"):
        # the run's first task: a missing credentials Secret or key fails here, in one line
        check_credentials(credentials_secret, [spec_uri])
        spec = load_spec_uri(spec_uri, list(overrides))
        check_credentials(credentials_secret, [spec.dataset.train or "", spec.dataset.val or ""])
        stages = ("prepare_data", "train", "evaluate", "prune", "retrain", "retrain_qat", "export", "ptq", "engine",
                  "validate")
        outputs = namedtuple("StageSpecs", "spec data_spec train_spec evaluate_spec prune_spec retrain_spec "
                                           "retrain_qat_spec export_spec ptq_spec engine_spec validate_spec registry_name")
        return outputs(spec_to_yaml(spec), *(stage_view(spec, name) for name in stages),
                       spec.tracking.registered_model)
