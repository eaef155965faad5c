"""Who makes and runs each quantized column, and what it stores (SPEC §15.1): our float32 export
quantized by onnxruntime's MatMulNBitsQuantizer, onnxruntime-genai's builder's int4 model of a
Hugging Face directory, CTranslate2's int8 of one, or torchao's weight-only int8 of impl_torch's
linear layers; each served by a runner the quantized column runs its cases through, with the
weights it multiplies by read back under the spec's names (export.quantize.DeployedWeights; None
where its activations are quantized at run time and no golden computes its products)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np

from spec import ModelConfig
from spec.quantization import QuantizationScheme


def column_name(scheme: QuantizationScheme) -> str:
    """onnx-int4-b32-sym (our export quantized by onnxruntime), onnxruntime-genai-int4 (its builder's),
    ctranslate2-int8 (CTranslate2's)."""
    if scheme.builder == "onnxruntime":
        return f"onnx-{scheme.name}"
    return "onnxruntime-genai-int4" if scheme.builder == "onnxruntime-genai" else scheme.name  # torchao-int8 too


def served(cfg: ModelConfig, params: Mapping[str, np.ndarray], scheme: QuantizationScheme, device: str,
            source: str | Path | None = None):
    """(the quantized export's runner, the weights it stores under the spec's names, its graphs by
    role beside their float twins)."""
    from conformance.backends.onnx_backend import OnnxRunner
    from export.quantize import deployed_weights, graphs_of, quantized_export
    from export.runner import OnnxTransformer

    if scheme.builder == "onnxruntime-genai":
        return _genai_served(cfg, params, source)
    if scheme.builder.startswith("ctranslate2"):
        return _ctranslate2_served(cfg, scheme, source), None, {}
    if scheme.builder == "torchao":
        return (*_torchao_served(cfg, params), {})
    directory = quantized_export(cfg, params, scheme)
    runner = OnnxRunner(OnnxTransformer(directory, device=device), f"onnx-{scheme.name}")
    if scheme.dynamic:
        return runner, None, {}
    graphs = graphs_of(cfg, params, directory)
    return runner, deployed_weights(cfg, params, graphs), graphs


def _genai_served(cfg: ModelConfig, params: Mapping[str, np.ndarray], source: str | Path | None):
    """onnxruntime-genai's builder's int4 model of the Hugging Face directory `source`: its runner
    (the genai column's: the rows it cannot compute the spec's way left out, with why), the weights it
    stores matched to the parameters by content, its graph as the forward (no float twin)."""
    import atexit
    import shutil
    import tempfile

    import onnx

    from conformance.backends.genai_backend import GenaiRunner, build_model
    from export.quantize import deployed_by_content

    if source is None:
        raise ValueError("onnxruntime-genai's builder reads a Hugging Face directory: give --hf DIR")
    folder = Path(tempfile.mkdtemp(prefix="rosetta-genai-int4-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    built = build_model(Path(source), cfg, folder, precision="int4")
    model = onnx.load(str(built / "model.onnx"))
    deployed, names = deployed_by_content(cfg, params, model)
    return GenaiRunner(built, cfg), deployed, {"forward": (None, model, None, names)}


def _torchao_served(cfg: ModelConfig, params: Mapping[str, np.ndarray]):
    """impl_torch's model (the torch column's runner, float32, CPU) with every nn.Linear made weight-only
    int8 by torchao (Int8WeightOnlyConfig), and the weights it stores read back under the spec's names
    (a module's path is its parameter's: impl_torch's state_dict keys are the canonical names)."""
    import torch

    from conformance.backends.torch_backend import TorchBackend
    from conformance.backends.transformers_backend import quiet_noisy_imports
    from export.quantize import DeployedWeights, StoredWeight, unrounded
    from spec.quantization import RowQuantized, dequantize_rows

    quiet_noisy_imports()
    try:
        from torchao.quantization import Int8WeightOnlyConfig, quantize_
    except ImportError as error:
        raise ValueError(f"torchao is not installed ({error}): pip install --no-deps torchao==0.18.0") from None
    runner = TorchBackend().load(cfg, params, "float32", "cpu")
    quantize_(runner.model, Int8WeightOnlyConfig(), filter_fn=lambda module, path: isinstance(module, torch.nn.Linear))
    deployed, stored = dict(params), {}
    for path, module in runner.model.named_modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        name, weight = f"{path}.weight", module.weight
        row = RowQuantized(weight.qdata.numpy(), weight.scale.numpy(), weight.zero_point.numpy())
        exact = dequantize_rows(row, name)  # [in, out]
        scales = np.broadcast_to(np.asarray(row.scales, np.float64).reshape(1, -1), exact.shape)  # [K, N]
        steps = np.maximum(np.abs(scales), np.finfo(np.float64).tiny)
        deployed[name] = exact.astype(np.float32)
        stored[name] = StoredWeight(8, None, True, float((np.abs(exact - params[name]) / steps).max(initial=0.0)),
                                    unrounded(params[name], row.codes.T.astype(np.int64), scales, 0, (-128, 127), 8))
    return runner, DeployedWeights(cfg, deployed, stored)


def _ctranslate2_served(cfg: ModelConfig, scheme: QuantizationScheme, source: str | Path | None):
    """CTranslate2's converter on the Hugging Face directory `source`, its Generator at the scheme's
    compute type (the ctranslate2 column's runner: the rows it cannot compute left out, with why)."""
    import atexit
    import shutil
    import tempfile

    from conformance.backends.ctranslate2_backend import CTranslate2Runner, convert_model

    if source is None:
        raise ValueError("CTranslate2's converter reads a Hugging Face directory: give --hf DIR")
    folder = Path(tempfile.mkdtemp(prefix="rosetta-ctranslate2-int8-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return CTranslate2Runner(convert_model(Path(source), cfg, folder), cfg, scheme.builder.removeprefix("ctranslate2-"))
