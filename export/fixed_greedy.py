"""Greedy generation on fixed buffers: every decode step of a generation binds the same memory,
so that on CUDA each step is one replay of a graph onnxruntime captured (``enable_cuda_graph``),
and the next token is chosen on the device.

    loop = FixedBufferGreedy(model)        # model: an OnnxTransformer
    tokens = loop.generate(prompt_ids=prompt, eos_id=2, max_new_tokens=64)

The tokens are OnnxTransformer.greedy_generate's (SPEC.md §7); what differs is where the work is:
- The logits [B, 1, V] stay on the device. A second, one-node graph (argmax_graph) writes each
  row's argmax, the lowest id on a tie, into the ids buffer the next step reads; only the B ids
  come to the host, to be recorded. (The runner copies the logits and takes the argmax in NumPy:
  on an H200 that bounded its loop, reports/gpu/nvidia-h200/ second run.)
- The cache's two buffer sets, the ids, keep-vector, position and logits are buffers this object
  owns and reuses in every generation of the same shape (batch, positions, source length): a
  captured graph replays at the addresses it was captured at. A generation of another shape gets
  buffers, and on CUDA a step session, of its own.
- A finished row goes on being fed its own argmax rather than pad_id, and its later tokens are
  set to pad_id on the host. The other rows cannot tell: no operation of the model mixes the rows
  of a batch.
On CUDA the step session is the model's decoder_step graph with its provider options and
``enable_cuda_graph``, one ``gpu_graph_id`` per parity of the two buffer sets (which set a step
reads alternates); the prompt is fed through the model's own session (its shape is the prompt's).
Its placement is the model's checked session's: same graph, providers and options.

One generation at a time: the buffers are this object's, not a call's (OnnxTransformer's own
methods stay safe to share between threads).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import onnx
import onnxruntime as ort

from export.graphs import DECODER_STEP, DECODER_STEP_IN_PLACE
from export.onnx_model import ExportError
from export.placement import cpu_fallbacks, fallback_message
from export.runner import (CPU, CUDA, OnnxCache, OnnxTransformer, _buffer, _cross_names, _names, first_tokens,
                           profiled_session, session_options)
from spec.inputs import CacheWrites, check_generation


def argmax_graph(dtype: str, vocab: int) -> bytes:
    """logits [B, 1, V] in the export's dtype -> next_ids [B, 1] int64: each row's argmax over the
    logits cast to float32 (exact from float16), the first index on a tie (ArgMax's
    select_last_index=0): the runner's host argmax, on the device."""
    element = onnx.helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("Cast", ["logits"], ["logits_float32"], to=onnx.TensorProto.FLOAT),
         onnx.helper.make_node("ArgMax", ["logits_float32"], ["next_ids"], axis=-1, keepdims=0, select_last_index=0)],
        "greedy_choice",
        [onnx.helper.make_tensor_value_info("logits", element, ["batch", 1, vocab])],
        [onnx.helper.make_tensor_value_info("next_ids", onnx.TensorProto.INT64, ["batch", 1])])
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 13)], ir_version=8)
    onnx.checker.check_model(model, full_check=True)
    return model.SerializeToString()


class FixedBufferGreedy:
    """Greedy generation of one OnnxTransformer on buffers reused from step to step and from one
    generation to the next; cuda_graph (default: on where the model runs on CUDA) captures each
    step as a CUDA graph."""

    def __init__(self, model: OnnxTransformer, *, cuda_graph: bool | None = None):
        if not model.step_graph:
            raise ExportError(f"{model.directory} has no decoder_step graph to generate with")
        cuda_graph = model.device == "cuda" if cuda_graph is None else cuda_graph
        if cuda_graph and model.device != "cuda":
            raise ValueError(f"CUDA graphs are captured on CUDA; this model's sessions run on {model.device}")
        self.model, self.cfg, self.cuda_graph = model, model.cfg, cuda_graph
        self.role = DECODER_STEP_IN_PLACE if model.in_place else DECODER_STEP
        self.choice = self._choice_session()
        self._shape: tuple | None = None  # (batch, capacity, source length) of the buffers

    def _choice_session(self) -> ort.InferenceSession:
        model = self.model
        graph = argmax_graph(model.dtype, self.cfg.tgt_vocab_size)
        if model.device != "cuda":
            return ort.InferenceSession(graph, session_options(**model.options), providers=model.providers)
        example = {"logits": np.zeros((2, 1, self.cfg.tgt_vocab_size), dtype=model.dtype)}
        session, placed = profiled_session(graph, model.options, model.providers, example)
        if CUDA not in session.get_providers():
            model._fallback(f"argmax: onnxruntime started the session on {session.get_providers()} only")
        elif fallbacks := cpu_fallbacks(placed):
            model._fallback(fallback_message("argmax", fallbacks))
        return session

    def _step_session(self) -> ort.InferenceSession:
        model = self.model
        if not self.cuda_graph:
            return model.sessions[self.role]
        provider, options = model.providers[0]
        return ort.InferenceSession(str(model.directory / model.graphs[self.role]), session_options(**model.options),
                                    providers=[(provider, {**options, "enable_cuda_graph": "1"}), CPU])

    def _prepare(self, batch: int, capacity: int, src_ids, src_keep) -> OnnxCache:
        """The fixed buffers as an empty cache of this shape: made on the first generation of a
        shape, zeroed on later ones, which find an earlier generation's cache there (a masked position gets weight 0, and 0 × NaN is NaN), the
        encoder run into the same cross buffers."""
        model, cfg = self.model, self.cfg
        shape = (batch, capacity, None if src_ids is None else np.shape(src_ids)[1])
        if shape != self._shape:
            cache = model.start_cache(batch, capacity, src_ids, src_keep)
            self._bind(cache)
            self._shape = shape
            return cache
        cache = self._empty
        for value, shape, dtype in self._buffers:
            value.update_inplace(np.zeros(shape, dtype))
        if cfg.has_encoder:
            keep, _memory, *_cross = model._encode(src_ids, src_keep, batch, into=cache.cross)
            cache.src_keep.update_inplace(keep)
        # the same buffers as a new line of caches: the last generation's are done with
        return replace(cache, length=0, writes=CacheWrites(), version=0)

    def _bind(self, cache: OnnxCache) -> None:
        """IO bindings of one step per parity: after the prompt, past is the cache's spare set,
        so parity 0 reads spare and writes past, parity 1 the reverse."""
        cfg, device = self.cfg, self.model.device
        self._empty = cache
        self._buffers = []  # each buffer once (in place, past and spare share K and V), its shape and dtype
        for value in {id(value): value for value in (*cache.past, *cache.spare)}.values():
            array = value.numpy()
            self._buffers.append((value, array.shape, array.dtype))
        self.session = self._step_session()
        batch = cache.batch
        self.ids = _buffer(np.zeros((batch, 1), dtype=np.int64), device)
        self.keep = _buffer(np.ones((batch, 1), dtype=bool), device)
        self.position = _buffer(np.zeros((), dtype=np.int64), device)
        logits_dtype = np.float16 if self.model.dtype == "float16" else np.float32
        self.logits = _buffer(np.zeros((batch, 1, cfg.tgt_vocab_size), dtype=logits_dtype), device)
        self.bindings, self.run_options = [], []
        for read, write in ((cache.spare, cache.past), (cache.past, cache.spare)):
            binding = self.session.io_binding()
            inputs = {"tgt_ids": self.ids, "tgt_keep": self.keep, "start": self.position, "past_keep": read[-1],
                      **dict(zip(_names("past", cfg), read))}
            if cfg.has_encoder:
                inputs.update({"src_keep": cache.src_keep, **dict(zip(_cross_names(cfg), cache.cross))})
            for name, value in inputs.items():
                binding.bind_ortvalue_input(name, value)
            binding.bind_ortvalue_output("logits", self.logits)
            for name, value in zip(_names("present", cfg) + ["present_keep"], write):
                binding.bind_ortvalue_output(name, value)
            self.bindings.append(binding)
            options = ort.RunOptions()
            if self.cuda_graph:
                options.add_run_config_entry("gpu_graph_id", str(len(self.bindings)))  # 1 and 2: -1 means no graph
            self.run_options.append(options)
        self.choice_binding = self.choice.io_binding()
        self.choice_binding.bind_ortvalue_input("logits", self.logits)
        self.choice_binding.bind_ortvalue_output("next_ids", self.ids)

    def generate(self, src_ids=None, *, prompt_ids=None, bos_id: int | None = None, src_keep=None,
                 eos_id: int | None = None, max_new_tokens: int) -> np.ndarray:
        """New tokens [B, max_new_tokens], as OnnxTransformer.greedy_generate (finished rows filled
        with pad_id; argmax ties go to the lowest id)."""
        cfg = self.cfg
        batch, _ = check_generation(cfg, src_ids, prompt_ids, bos_id, max_new_tokens)
        first, first_keep = first_tokens(cfg, batch, prompt_ids, bos_id)
        # room for the first tokens and every generated one but the last, which is never fed back
        cache = self._prepare(batch, first.shape[1] + max_new_tokens - 1, src_ids, src_keep)
        logits, _cache = self.model.decode_step(cache, first, first_keep)  # writes the spare set
        token = logits[:, -1].astype(np.float32).argmax(axis=-1)
        tokens = np.full((batch, max_new_tokens), cfg.pad_id, dtype=np.int64)
        finished = np.zeros(batch, dtype=bool)
        for t in range(max_new_tokens):
            if t > 0:
                self.position.update_inplace(np.array(first.shape[1] + t - 1, dtype=np.int64))
                parity = (t - 1) % 2
                self.session.run_with_iobinding(self.bindings[parity], self.run_options[parity])
                self.choice.run_with_iobinding(self.choice_binding)  # the next ids, into self.ids
                token = self.ids.numpy()[:, 0]
            tokens[:, t] = np.where(finished, cfg.pad_id, token)
            if eos_id is not None:
                finished |= token == eos_id
            if finished.all():
                break
            if t == 0:
                self.ids.update_inplace(token[:, None].astype(np.int64))
        return tokens

