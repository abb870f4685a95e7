"""`qatpipe compile | submit`: the pipeline as a KFP package, and a run of it on a Kubeflow Pipelines backend."""

from __future__ import annotations

from pathlib import Path

from qatpipe.cli.common import check_file
from qatpipe.errors import QatpipeError


def add_commands(sub) -> None:
    compile_ = sub.add_parser("compile", help="compile the pipeline to a KFP package (YAML)")
    compile_.add_argument("-o", "--output", type=Path, default=Path("qat_pipeline.yaml"))
    compile_.add_argument("--cache-pvc", help="mount this PVC as the dataset cache of the data-reading stages")
    compile_.add_argument("--mpijob", action="store_true",
                          help="train and retrain always run as MPIJobs (workers x gpus); their own tasks only "
                               "follow the job and request no GPU (needs --cache-pvc)")
    compile_.add_argument("--shm-size", help="memory-backed /dev/shm of the training tasks (a Kubernetes quantity; "
                                             "default 8Gi; counted in their memory limit, training_memory)")
    compile_.set_defaults(func=cmd_compile, check=check_compile)

    submit = sub.add_parser("submit", help="create a pipeline run on a Kubeflow Pipelines backend",
                            description="Token: $KFP_TOKEN, else the kube config's current user. The run's spec "
                                        "(spec_uri, spec_overrides) is checked here first where this machine can "
                                        "read it.")
    submit.add_argument("--host", required=True, help="KFP API endpoint, e.g. https://kubeflow.example.com/pipeline")
    submit.add_argument("--experiment", default="qatpipe", help="KFP experiment (default: qatpipe)")
    submit.add_argument("--namespace", help="Kubeflow profile namespace (multi-user deployments)")
    submit.add_argument("--service-account", help="the ServiceAccount the run's pods use (standalone KFP: "
                                                  "pipeline-runner; Kubeflow profiles: default-editor)")
    submit.add_argument("--run-name", help="KFP run name")
    submit.add_argument("--package", type=Path, help="a compiled pipeline YAML (default: compile now)")
    submit.add_argument("arguments", nargs="*", metavar="NAME=VALUE",
                        help="pipeline parameters, e.g. spec_uri=s3://bucket/spec.yaml gpus=2")
    submit.set_defaults(func=cmd_submit, check=check_submit)


def check_compile(args) -> None:
    from qatpipe_pipelines.submit import check_compile_options

    if args.mpijob and not args.cache_pvc:
        raise QatpipeError("--mpijob needs --cache-pvc: the MPIJobs share their data and results through it")
    check_compile_options(args.cache_pvc, args.shm_size)


def cmd_compile(args) -> int:
    from qatpipe_pipelines.submit import compile_pipeline

    compile_pipeline(args.output, cache_pvc=args.cache_pvc, mpijob=args.mpijob, shm_size=args.shm_size)
    return 0


def check_submit(args) -> None:
    """The endpoint, the package, the parameters and the spec, before anything is compiled or sent."""
    from qatpipe_pipelines.submit import check_host, check_spec, parse_arguments

    check_host(args.host)
    check_file(args.package, "--package", "pipeline package")
    args.pipeline_arguments = parse_arguments(args.arguments)
    check_spec(args.pipeline_arguments)


def cmd_submit(args) -> int:
    from qatpipe_pipelines.submit import submit

    url = submit(args.host, args.pipeline_arguments, experiment=args.experiment,
                 namespace=args.namespace, run_name=args.run_name, package=args.package,
                 service_account=args.service_account)
    print(url)
    return 0
