"""gpu-placement: the node selector of the GPU stages, from the pipeline's node_selector and gpu_type, so that
gpu_type both pins the GPU model and keys build-engine's cache."""

from qatpipe_kfp.settings import component


@component
def gpu_placement(node_selector: dict, gpu_type: str) -> dict:
    """Compute the GPU stages' node selector: node_selector plus the gpu_type's GPU model label.

    Args:
        node_selector: The pipeline's node labels for GPU stages.
        gpu_type: The GPU model engines are built for, as nvidia.com/gpu.product names it. Empty: no model pinned.

    Returns:
        Output: node_selector with nvidia.com/gpu.product set to gpu_type when it is named (a node_selector that
            pins another model fails the task, naming both).
    """
    from qatpipe.devices import gpu_node_selector
    from qatpipe_kfp.runtime import log, stage

    with stage("gpu-placement"):
        selector = gpu_node_selector(node_selector, gpu_type)
        log.info("GPU stages run on nodes with %s", selector or "any labels")
        return selector
