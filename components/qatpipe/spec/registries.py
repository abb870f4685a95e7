"""The registry rows whose names a spec may give, kept on the spec's floor so its checks need no import from above.

Each row names its module (not imported: the spec checks a name without loading TensorFlow or TensorRT).
models/backbones.py and engines/__init__.py load the modules these rows name.
"""

from __future__ import annotations

# model.backbone.name -> its module (models/backbones.py says what a backbone module provides). Adding a backbone is
# its module and one line here: the spec's check, the tests and bench/backbones.py read this table.
BACKBONES = {
    "resnet": "qatpipe.models.resnet",  # TAO's ResNet 10/18/34 (model.backbone.depth)
    "mobilenet_v2": "qatpipe.models.mobilenet_v2",  # depthwise, ReLU6
    "efficientnet_b0": "qatpipe.models.efficientnet",  # depthwise, SiLU, squeeze-excitation
}

# engine.backend -> "module:class" (an EngineBackend). Adding a backend is its module and one line here: the spec's
# check and the CLI's --backend choices read this table.
BACKENDS = {
    "tensorrt": "qatpipe.engines.tensorrt_backend:TensorRTBackend",
    "onnxruntime": "qatpipe.engines.onnxruntime_backend:OnnxRuntimeBackend",
}
