"""`qatpipe compare`: the FP32/PTQ/QAT table of a pipeline run, read back from MLflow."""

from __future__ import annotations

import os
from pathlib import Path

from qatpipe.cli.common import EXIT_BAD_INPUT, log
from qatpipe.errors import QatpipeError


def add_commands(sub) -> None:
    compare = sub.add_parser("compare", help="the FP32/PTQ/QAT table of a pipeline run, from MLflow")
    compare.add_argument("--run-id", help="MLflow parent run id (default: the experiment's latest pipeline run)")
    compare.add_argument("--experiment", default="qatpipe")
    compare.add_argument("--tracking-uri", help="an MLflow server (http://...), a database (sqlite:///FILE.db) or a "
                         "`run --local` output folder; default: $MLFLOW_TRACKING_URI, else results/pipeline's store "
                         "(`make main`'s) when there is one")
    compare.add_argument("-o", "--output", type=Path, default=Path("comparison.png"), help="bar chart (PNG)")
    compare.set_defaults(func=cmd_compare, check=check_compare)


def check_compare(args) -> None:
    args.store = tracking_store(args.tracking_uri)


def tracking_store(given: str | None) -> str:
    """The MLflow store to read: --tracking-uri, else $MLFLOW_TRACKING_URI, else the SQLite store of
    `qatpipe run --local`'s default output folder when there is one. Logs which and why."""
    from qatpipe.tracking.mlflow_runs import TRACKING_URI_ENV, redact_uri
    from qatpipe_pipelines.local_run import DEFAULT_OUTPUT, MLFLOW_STORE

    from_env = os.environ.get(TRACKING_URI_ENV, "").strip()
    if given or from_env:
        source = "--tracking-uri" if given else f"${TRACKING_URI_ENV}"
        uri = _store_uri(given or from_env, source)
    elif (DEFAULT_OUTPUT / MLFLOW_STORE).is_file():
        source, uri = "the store `qatpipe run --local` (make main) wrote", _sqlite(DEFAULT_OUTPUT / MLFLOW_STORE)
    else:
        raise QatpipeError(f"no MLflow store: pass --tracking-uri or set {TRACKING_URI_ENV} (there is no "
                           f"{DEFAULT_OUTPUT / MLFLOW_STORE}, where `make main` writes one)")
    log.info("reading MLflow at %s (%s)", redact_uri(uri), source)
    return uri


def _sqlite(path: Path) -> str:
    return f"sqlite:///{path.resolve()}"


def _store_uri(value: str, source: str) -> str:
    """`value` as a store MLflow can open: a server or database URI as given (a SQLite file must exist: MLflow
    would make an empty one), or a `run --local` folder or .db file as its SQLite URI."""
    from qatpipe_pipelines.local_run import MLFLOW_STORE

    scheme = value.partition("://")[0].lower() if "://" in value else ""
    if scheme.startswith("sqlite"):
        path = Path(value.split("://", 1)[1][1:].split("?")[0])
        if not path.is_file():
            raise QatpipeError(f"{source} {value}: no such SQLite file ({path})")
        return value
    if scheme not in ("", "file"):
        return value  # a server (http, https, databricks) or another database: MLflow reports what it cannot reach
    path = Path(value.removeprefix("file://"))
    if path.is_dir() and (path / MLFLOW_STORE).is_file():
        return _sqlite(path / MLFLOW_STORE)
    if path.is_file() and path.suffix == ".db":
        return _sqlite(path)
    raise QatpipeError(f"{source} {value}: not an MLflow store; give a server (http://HOST:5000), a database "
                       f"(sqlite:///FILE.db) or a `qatpipe run --local` output folder (with {MLFLOW_STORE})")


def cmd_compare(args) -> int:
    from qatpipe.metrics.comparison_charts import plot_variants
    from qatpipe.metrics.comparison_report import report
    from qatpipe.metrics.comparisons import comparisons_from_metrics
    from qatpipe.tracking.mlflow_runs import MlflowTracker
    from qatpipe.tracking.registry import loading_snippet, pipeline_models

    tracker = MlflowTracker(args.store)
    run_id = args.run_id or tracker.latest_pipeline_run(args.experiment)
    variants = tracker.read_variants(run_id)
    if not variants:
        log.error("MLflow run %s has no variant figures (did its compare stage run?)", run_id)
        return EXIT_BAD_INPUT
    chart = plot_variants(variants, args.output)
    log.info("pipeline run %s; chart: %s", run_id, chart)
    print(report({"variants": variants, "comparisons": comparisons_from_metrics(tracker.read_comparisons(run_id))}))
    models, version = pipeline_models(tracker, run_id)
    if models:
        print("\nMLflow models: " + ", ".join(f"{name} {uri}" for name, uri in models.items()))
    if version is not None:
        alias = next(iter(sorted(version.aliases)), None)
        uri = f"models:/{version.name}@{alias}" if alias else f"models:/{version.name}/{version.version}"
        print(f"QAT: {version.name} version {version.version} ({version.tags.get('qatpipe.gate', '?')} the gate)"
              f"{f', @{alias}' if alias else ''}. To run it on an image:\n\n{loading_snippet(uri)}")
    return 0
