"""ONNX export and onnxruntime serving (issue: 'ONNX export and onnxruntime serving').

Not written yet: nothing is registered with the harness until this package implements it."""
