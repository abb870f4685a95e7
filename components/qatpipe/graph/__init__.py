"""Graph utilities on the library's ground floor, for the floors above (tests/test_layers.py lists them):
onnx_graph.py edits ONNX graphs in place (quantization, export and engines use it), cpu_qdq.py rewrites a
TensorRT Q/DQ model into ONNX Runtime CPU forms that compute TensorRT's int8 numbers (engines run it;
sensitivity scores with it), keras_graph.py views a tf_keras functional model as a graph (pruning and
quantization rebuild models with it)."""
