"""INT8 quantisation for TensorRT: post-training (ptq.py, ONNX Runtime static quantisation); QAT follows."""
