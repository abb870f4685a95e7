"""gpu-placement: where the GPU stages run and what the training tasks hold, from the pipeline's parameters:
gpu_type joins the node selector (so it pins the GPU model that keys build-engine's cache), and a training task
whose training runs as an MPIJob or TrainJob (workers > 1) holds no GPU and takes the light sizes."""

from typing import NamedTuple

from qatpipe_kfp.settings import component


@component
def gpu_placement(node_selector: dict, gpu_type: str, gpus: int, workers: int, training_cpu: str,
                  training_memory: str, light_cpu: str, light_memory: str) -> NamedTuple(
        "Placement", [("node_selector", dict), ("training_gpus", int), ("training_cpu", str),
                      ("training_memory", str)]):
    """Compute where the GPU stages run and what the training tasks hold.

    Args:
        node_selector: The pipeline's node labels for GPU stages.
        gpu_type: The GPU model engines are built for, as nvidia.com/gpu.product names it. Empty: no model pinned.
        gpus: GPUs per training / engine stage.
        workers: Nodes for train and retrain; above 1 they run as MPIJobs or TrainJobs.
        training_cpu: The CPU request of a training task that trains itself.
        training_memory: The memory of a training task that trains itself.
        light_cpu: The CPU of a task that only follows its job.
        light_memory: The memory of a task that only follows its job.

    Returns:
        node_selector: node_selector with nvidia.com/gpu.product set to gpu_type when it is named (a node_selector
            that pins another model fails the task, naming both).
        training_gpus: The GPUs train and retrain tasks request: gpus on one node, 0 when their job's pods hold them.
        training_cpu: The training tasks' CPU request: training_cpu on one node, light_cpu when they follow a job.
        training_memory: The training tasks' memory: training_memory on one node, light_memory when they follow a job.
    """
    from collections import namedtuple

    from qatpipe.devices import gpu_node_selector, training_task_holds_gpus
    from qatpipe_kfp.runtime import log, stage

    with stage("gpu-placement"):
        selector = gpu_node_selector(node_selector, gpu_type)
        trains_here = training_task_holds_gpus(workers)
        log.info("GPU stages run on nodes with %s; training tasks %s", selector or "any labels",
                 f"hold {gpus} GPU(s)" if trains_here else f"follow their {workers}-node jobs and hold no GPU")
        outputs = namedtuple("Placement", ["node_selector", "training_gpus", "training_cpu", "training_memory"])
        if trains_here:
            return outputs(selector, gpus, training_cpu, training_memory)
        return outputs(selector, 0, light_cpu, light_memory)
