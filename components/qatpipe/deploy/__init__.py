"""Hand-off to deployment stacks: DeepStream (deepstream.py) and MLflow models (mlflow_model.py)."""
