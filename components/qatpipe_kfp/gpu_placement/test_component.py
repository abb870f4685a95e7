import pytest

from qatpipe.errors import QatpipeError
from qatpipe_kfp.gpu_placement.component import gpu_placement


def test_gpu_type_joins_the_node_selector():
    selector = gpu_placement.python_func(node_selector={"pool": "gpu"}, gpu_type="NVIDIA-A100-SXM4-80GB")
    assert selector == {"pool": "gpu", "nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB"}
    assert gpu_placement.python_func(node_selector={"pool": "gpu"}, gpu_type="") == {"pool": "gpu"}


def test_a_node_selector_pinning_another_model_is_refused():
    with pytest.raises(QatpipeError, match="pins nvidia.com/gpu.product='NVIDIA-L4' but gpu_type is 'NVIDIA-A10'"):
        gpu_placement.python_func(node_selector={"nvidia.com/gpu.product": "NVIDIA-L4"}, gpu_type="NVIDIA-A10")
