"""qatpipe: FP32 training to validated INT8 TensorRT deployment of object detectors."""

import os

# tf_keras (Keras 2) throughout: TFMOT, tf2onnx's from_keras and Horovod's Keras wrapper need it.
# Set before anything imports tensorflow.
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

__version__ = "0.1.0"
