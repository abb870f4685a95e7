import pytest

from qatpipe.errors import QatpipeError
from qatpipe_kfp.gpu_placement.component import gpu_placement

SIZES = dict(training_cpu="8", training_memory="32Gi", light_cpu="1", light_memory="2Gi")


def test_gpu_type_joins_the_node_selector_and_one_node_trains_in_its_task():
    placed = gpu_placement.python_func(node_selector={"pool": "gpu"}, gpu_type="NVIDIA-A100-SXM4-80GB", gpus=2,
                                       workers=1, **SIZES)
    assert placed.node_selector == {"pool": "gpu", "nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB"}
    assert (placed.training_gpus, placed.training_cpu, placed.training_memory) == (2, "8", "32Gi")
    assert gpu_placement.python_func(node_selector={"pool": "gpu"}, gpu_type="", gpus=1, workers=1,
                                     **SIZES).node_selector == {"pool": "gpu"}


def test_a_training_task_following_a_multi_node_job_holds_no_gpu_and_the_light_sizes():
    placed = gpu_placement.python_func(node_selector={}, gpu_type="", gpus=4, workers=3, **SIZES)
    assert (placed.training_gpus, placed.training_cpu, placed.training_memory) == (0, "1", "2Gi")


def test_a_node_selector_pinning_another_model_is_refused():
    with pytest.raises(QatpipeError, match="pins nvidia.com/gpu.product='NVIDIA-L4' but gpu_type is 'NVIDIA-A10'"):
        gpu_placement.python_func(node_selector={"nvidia.com/gpu.product": "NVIDIA-L4"}, gpu_type="NVIDIA-A10",
                                  gpus=1, workers=1, **SIZES)
