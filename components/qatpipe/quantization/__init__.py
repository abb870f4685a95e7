"""INT8 quantization for TensorRT: QAT (the quantize config in layers.py and quantizers.py, the placement rules in
rules.py, the transform that applies them in transform.py) and the post-training baseline (ptq.py, ONNX Runtime
static quantization)."""
