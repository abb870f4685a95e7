"""`qatpipe run --local`: the whole pipeline on this machine, through kfp.local."""

from __future__ import annotations

from pathlib import Path

from qatpipe.cli.common import EXIT_GATE_FAILED, add_overrides, log


def add_commands(sub) -> None:
    from qatpipe_pipelines.local_run import DEFAULT_OUTPUT

    run = sub.add_parser("run", help="run the whole pipeline (--local: through kfp.local on this machine)",
                         description="Exits 1 when the QAT model misses the validation gate (the results are kept).")
    run.add_argument("--local", action="store_true", required=True,
                     help="run here, each stage a subprocess (on a cluster: `qatpipe submit`)")
    run.add_argument("--spec", default="default", help="spec file, s3:// URI or bundled name (default: default)")
    run.add_argument("--output", type=Path, default=DEFAULT_OUTPUT,
                     help=f"results, MLflow store and stage cache (default: {DEFAULT_OUTPUT}); re-use it to resume")
    add_overrides(run, "override a spec key (repeatable)")
    run.add_argument("--run-name", help="MLflow parent run name (default: the output folder's name)")
    run.add_argument("--runner", choices=("subprocess", "docker"), default="subprocess",
                     help="subprocess: each stage a process here; docker: each stage in its image (`make images`), "
                          "MLflow in the MLflow image, through Docker or podman ($DOCKER_HOST)")
    run.set_defaults(func=cmd_run, check=check_run)


def check_run(args) -> None:
    """The spec and its overrides, before the output folder is made (run_local checks it again, as the stages
    would read it)."""
    from qatpipe.spec_sources import load_spec_uri

    load_spec_uri(args.spec, args.overrides)


def cmd_run(args) -> int:
    from qatpipe.metrics.comparison_report import report
    from qatpipe_pipelines.local_run import SUMMARY_FILE, run_local

    summary = run_local(args.output, args.spec, args.overrides, run_name=args.run_name or "", runner=args.runner)
    log.info("summary: %s", args.output / SUMMARY_FILE)
    if "mlflow" in summary:
        log.info("MLflow: run %s in experiment %r at %s", summary["mlflow"]["run_id"],
                 summary["mlflow"]["experiment"], summary["mlflow"]["tracking_uri"])
    print(report(summary))  # the answer, for people and scripts
    return EXIT_GATE_FAILED if summary.get("gate_passed") is False else 0
