"""ONNX export and onnxruntime serving.

- export.graphs: the graph roles (forward, encoder, decoder_step) and their
  input/output names and layouts, shared by both exporters and the runner.
- export.torch_export: every graph from impl_torch with torch.onnx.export(dynamo=True).
- export.jax_export: the forward and encoder graphs from impl_jax with jax2onnx.
- export.exporters: export_model, either exporter chosen by framework name.
- export.onnx_model: what every graph gets (IR version, metadata, the full checker).
- export.runner: OnnxTransformer, onnxruntime sessions (CUDA then CPU) with greedy generation.
- export.fixed_greedy: greedy generation on fixed buffers, each step a CUDA graph's replay on CUDA.
- export.cache: exports kept on disk between runs.
- export.triton: a Triton Inference Server model repository for the graphs.
"""
