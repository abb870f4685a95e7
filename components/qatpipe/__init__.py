"""qatpipe: FP32 training to validated INT8 TensorRT deployment of object detectors."""

import glob
import os

# tf_keras (Keras 2) throughout: TFMOT, tf2onnx's from_keras and Horovod's Keras wrapper need it.
# Set before anything imports tensorflow.
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
# TensorFlow's C++ log: warnings and errors; on a machine with no GPU device (NVIDIA's, WSL's, Jetson's) only
# fatal ones, so a CPU-only run does not print "failed call to cuInit" (an ERROR) each time TensorFlow loads.
_GPU_DEVICES = ("/dev/nvidia[0-9]*", "/dev/dxg", "/dev/nvhost-*", "/dev/nvgpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL",
                      "2" if any(glob.glob(pattern) for pattern in _GPU_DEVICES) else "3")

from qatpipe.tf_log import quiet_tensorflow_import  # noqa: E402 (after the environment it reads)

quiet_tensorflow_import()  # the level holds also for what TensorFlow prints while it loads

__version__ = "0.1.0"
