"""resolve-spec: read the spec (bundled name, file in the image, or s3://), apply overrides, validate, and
hand each stage the sections it reads (qatpipe.spec.STAGE_SECTIONS)."""

from typing import List, NamedTuple

from qatpipe_kfp.settings import component


# The return type is spelled out in the signature: KFP ships only the function's source to the pod.
@component
def resolve_spec(spec_uri: str, overrides: List[str]) -> NamedTuple(
        "StageSpecs", [("spec", str), ("data_spec", str), ("train_spec", str), ("evaluate_spec", str)]):
    from collections import namedtuple

    from qatpipe.spec import spec_to_yaml, stage_view
    from qatpipe.spec_sources import load_spec_uri
    from qatpipe_kfp.runtime import stage

    with stage("resolve-spec"):
        spec = load_spec_uri(spec_uri, list(overrides))
        outputs = namedtuple("StageSpecs", "spec data_spec train_spec evaluate_spec")
        return outputs(spec_to_yaml(spec), stage_view(spec, "prepare_data"), stage_view(spec, "train"),
                       stage_view(spec, "evaluate"))
