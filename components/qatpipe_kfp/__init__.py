"""Kubeflow Pipelines components: one folder each (component.py + README.md), thin wrappers over the stage
functions in `qatpipe.stages`. Component bodies import inside the function: KFP ships only the function's
source to the pod, where the project image provides `qatpipe` and `qatpipe_kfp`."""
