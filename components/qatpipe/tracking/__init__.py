"""Experiment tracking: stages write StageRecords (records.py); MlflowTracker logs them (mlflow_runs.py)."""

from qatpipe.tracking.records import RECORD_FILE, StageRecord, history_from_csv, numeric_leaves

__all__ = ["RECORD_FILE", "StageRecord", "history_from_csv", "numeric_leaves"]
