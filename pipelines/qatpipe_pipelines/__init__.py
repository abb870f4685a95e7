"""The qatpipe Kubeflow pipeline (qat_pipeline.py), its local run (local_run.py) and submission (submit.py)."""
