"""Running exported models: ONNX Runtime (always available) here; TensorRT joins with the engine stage."""
