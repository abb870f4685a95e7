"""The GPU-model check of engine tasks. No GPU or driver runs here, so `nvidia-smi` is a stand-in script on
PATH that prints what the real one prints for `--query-gpu=name --format=csv,noheader`."""

from __future__ import annotations

import pytest

from qatpipe.devices import check_gpu_type, gpu_names
from qatpipe.errors import QatpipeError


@pytest.fixture
def nvidia_smi(tmp_path, monkeypatch):
    def install(*names: str):
        script = tmp_path / "nvidia-smi"
        script.write_text("#!/bin/sh\n" + "".join(f"echo '{name}'\n" for name in names))
        script.chmod(0o755)
        monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")

    return install


def test_the_label_and_the_driver_name_one_model(nvidia_smi):
    nvidia_smi("NVIDIA A100-SXM4-80GB", "NVIDIA A100-SXM4-80GB")
    assert gpu_names() == ["NVIDIA A100-SXM4-80GB"] * 2
    check_gpu_type("NVIDIA-A100-SXM4-80GB")  # GPU feature discovery's nvidia.com/gpu.product spelling
    check_gpu_type("")  # no gpu_type: no check


def test_another_model_or_no_gpu_is_refused(nvidia_smi, monkeypatch, tmp_path):
    nvidia_smi("NVIDIA L4")
    with pytest.raises(QatpipeError, match=r"gpu_type is 'NVIDIA-A100-SXM4-80GB', but this node's GPU is "
                                           r"'NVIDIA L4': pin the GPU model with node_selector"):
        check_gpu_type("NVIDIA-A100-SXM4-80GB")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(QatpipeError, match="no NVIDIA GPU is visible"):
        check_gpu_type("NVIDIA L4")


def test_the_gpu_stages_selector_and_who_holds_the_training_gpus():
    from qatpipe.devices import GPU_PRODUCT_LABEL, gpu_node_selector, training_task_holds_gpus

    assert gpu_node_selector({"pool": "gpu"}, " ") == {"pool": "gpu"}
    assert gpu_node_selector({}, "NVIDIA-L4") == {GPU_PRODUCT_LABEL: "NVIDIA-L4"}
    assert gpu_node_selector({GPU_PRODUCT_LABEL: "NVIDIA-L4"}, "NVIDIA-L4") == {GPU_PRODUCT_LABEL: "NVIDIA-L4"}
    assert training_task_holds_gpus(1) and not training_task_holds_gpus(2)
    with pytest.raises(QatpipeError, match="workers is 0"):
        training_task_holds_gpus(0)
