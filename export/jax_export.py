"""Export impl_jax's Transformer to ONNX with jax2onnx: the forward and encoder graphs, with the
same interface as the torch export (export/graphs.py), so the two can be checked against each
other and against the golden.

Two differences from the torch export, both from JAX:
- JAX computes with int32 ids (int64 needs x64 mode), so jax2onnx's graph takes int32. Each ids
  input is turned back into int64 with a Cast at the graph's entrance: every export takes the
  same ids.
- Shapes are symbolic (jax.export) and the sinusoidal table is computed on the host, so the graph
  holds a table of max_len positions and takes sequences up to max_len (manifest.json's
  ``max_positions``; the runner refuses longer ones). The torch export computes sinusoids in the
  graph and has no such limit.

jax2onnx declares a dependency on the CPU ``onnxruntime`` package, which would overwrite
onnxruntime-gpu's module: it is installed with ``--no-deps`` (see the Makefile) and needs only
what is installed already (jax, flax, onnx, onnx-ir, ml_dtypes).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import onnx

from export.graphs import ENCODER, FORWARD, FORWARD_ROUTED, GraphSignature, signature
from export.onnx_model import OPSETS, ExportError, SharedWeights, check_options, finish, quiet_loggers, save, write_manifest
from impl_jax.model import Transformer, graph_routing
from spec import ModelConfig

JAX_ROLES = (FORWARD, ENCODER, FORWARD_ROUTED)


def _version() -> str:
    from importlib.metadata import version

    return f"jax {jax.__version__}, jax2onnx {version('jax2onnx')}"


def _function(model: Transformer, role: str):
    cfg = model.cfg
    if role == ENCODER:
        def encoder(src_ids, src_keep):
            memory = model.encode(src_ids, src_keep)
            cross = []
            for layer in model.decoder.layers:
                cross.extend(layer.cross_attn.key_value_heads(memory))
            return (memory, *cross)
        return encoder
    if cfg.has_encoder:
        def forward(src_ids, src_keep, tgt_ids, tgt_keep):
            memory = model.encode(src_ids, src_keep)
            return model.output_logits(model.decode(tgt_ids, tgt_keep, memory, src_keep))
        return forward

    def forward_decoder_only(tgt_ids, tgt_keep):
        return model.output_logits(model.decode(tgt_ids, tgt_keep))
    if role != FORWARD_ROUTED:
        return forward_decoder_only

    def forward_routed(tgt_ids, tgt_keep, forced_experts, forced_weights, replay):
        taken, weighed = [], []  # each MoE layer's choices and own weights [B·T, k], in layer order
        with graph_routing(forced_experts, forced_weights, replay, taken, weighed):
            logits = forward_decoder_only(tgt_ids, tgt_keep)
        return (logits, jnp.stack(taken).reshape(forced_experts.shape),
                jnp.stack(weighed).reshape(forced_weights.shape).astype(forced_weights.dtype))
    return forward_routed


def _symbolic_inputs(cfg: ModelConfig, sig: GraphSignature, dtype: str) -> list[jax.ShapeDtypeStruct]:
    """Symbolic shapes for the dynamic axes; lengths are bounded by the position table."""
    names = ("batch", "src_len", "tgt_len")
    dims = dict(zip(names, jax.export.symbolic_shape(
        ", ".join(names), constraints=[f"src_len <= {cfg.max_len}", f"tgt_len <= {cfg.max_len}"])))
    kinds = {"ids": jnp.int32, "keep": jnp.bool_, "experts": jnp.int32, "flag": jnp.bool_, "float": jnp.dtype(dtype)}
    return [jax.ShapeDtypeStruct(tuple(dims[d] if isinstance(d, str) else d for d in t.dims), kinds[t.kind])
            for t in sig.inputs]


def _int64_ids(model: onnx.ModelProto) -> None:
    """Make each int32 graph input int64, cast to int32 on entry (JAX's ids are int32), and each
    int32 output int64, cast on the way out."""
    graph = model.graph
    casts = []
    for graph_input in graph.input:
        tensor_type = graph_input.type.tensor_type
        if tensor_type.elem_type != onnx.TensorProto.INT32:
            continue
        inner = f"{graph_input.name}__int32"
        for node in graph.node:
            node.input[:] = [inner if name == graph_input.name else name for name in node.input]
        tensor_type.elem_type = onnx.TensorProto.INT64
        casts.append(onnx.helper.make_node("Cast", [graph_input.name], [inner], to=onnx.TensorProto.INT32,
                                           name=f"{graph_input.name}_to_int32"))
    for position, cast in enumerate(casts):
        graph.node.insert(position, cast)
    for graph_output in graph.output:  # forward_routed's chosen_experts: int64 out, as the torch export's
        tensor_type = graph_output.type.tensor_type
        if tensor_type.elem_type != onnx.TensorProto.INT32:
            continue
        inner = f"{graph_output.name}__int32"
        for node in graph.node:
            node.output[:] = [inner if name == graph_output.name else name for name in node.output]
            node.input[:] = [inner if name == graph_output.name else name for name in node.input]
        tensor_type.elem_type = onnx.TensorProto.INT64
        graph.node.append(onnx.helper.make_node("Cast", [inner], [graph_output.name], to=onnx.TensorProto.INT64,
                                                name=f"{graph_output.name}_to_int64"))


def export_graph(model: Transformer, params: Mapping[str, np.ndarray], role: str, *, dtype: str = "float32",
                 opset: int = OPSETS[0]) -> onnx.ModelProto:
    with quiet_loggers("jax2onnx.plugins.plugin_system"):
        from jax2onnx import to_onnx

    cfg = model.cfg
    if role not in JAX_ROLES:
        raise ExportError(f"the JAX export writes the {' and '.join(JAX_ROLES)} graphs, not {role!r}; "
                          "decoder graphs come from the torch export")
    sig = signature(cfg, role)
    # jax2onnx's tracing warns about dtypes it truncates and untyped constants it skips; neither
    # concerns the graph, which is checked by finish() and by the tests against the golden.
    # impl_jax picks its attention path by platform (impl_jax.model.native_attention_fails), so a
    # graph traced where the default backend is a GPU would differ from one traced on a CPU: at
    # float16 it took jax.nn.dot_product_attention, whose conversion left a float32 scale in a
    # float16 graph (onnx: "Mul ... B has inconsistent type tensor(float)", seen on an H100). The
    # trace runs with the CPU as the default device: the same graph wherever it is exported.
    with (warnings.catch_warnings(), quiet_loggers("onnx_ir.serde", "jax2onnx.plugins.plugin_system"),
          jax.default_matmul_precision("highest"), jax.default_device(jax.devices("cpu")[0])):
        warnings.simplefilter("ignore")
        proto = to_onnx(_function(model, role), _symbolic_inputs(cfg, sig, dtype), opset=opset,
                        model_name=f"rosetta_{role}", input_names=sig.input_names, output_names=sig.output_names)
    _int64_ids(proto)
    return finish(proto, cfg, params, sig, dtype=dtype, opset=opset, exporter=_version(),
                  extra={"max_positions": str(cfg.max_len)})


def export_jax(cfg: ModelConfig, params: Mapping[str, np.ndarray], directory: str | Path, *,
               dtype: str = "float32", opset: int = OPSETS[0], graph_roles: tuple[str, ...] | None = None) -> dict[str, Path]:
    """Export the forward (and, for an encoder-decoder, the encoder) graph into directory."""
    available = tuple(r for r in JAX_ROLES if (r != ENCODER or cfg.has_encoder) and (r != FORWARD_ROUTED or cfg.moe))
    wanted = check_options(dtype, opset, graph_roles, available, "JAX")
    model = Transformer.from_params(cfg, params, dtype=dtype)
    directory = Path(directory)
    weights = SharedWeights(directory)
    paths = {role: save(export_graph(model, params, role, dtype=dtype, opset=opset), directory / f"{role}.onnx", weights)
             for role in wanted}
    write_manifest(directory, cfg, params, {role: path.name for role, path in paths.items()},
                   dtype=dtype, opset=opset, exporter=_version(), max_positions=cfg.max_len)
    return paths
