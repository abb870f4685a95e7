"""Export to ONNX (tf2onnx): the deployment artifact that TensorRT and ONNX Runtime both read."""
