"""The contenders: every implementation (and CTranslate2, the outside peer) built from the same
canonical weights, behind one small interface the workloads time.

    forward(src, tgt)             teacher-forced logits, computed to completion
    generate(src, n)              greedy tokens [B, n] with the KV cache (numpy int64)
    step(src, past_len)           a function that runs one cached decode step at position past_len
                                  (the cache is prefilled outside the timing)

On a GPU the clock must not stop before the device has finished: every timed call ends with
finish(), which waits for the device, and leaves its output there; to_host() is the copy to the
host, timed as a figure of its own.

A method a contender does not have raises Skip with the reason; so does a contender whose
framework is not installed or whose device is absent.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np

import impl_numpy as golden
from conformance.adapter import NotSupported
from spec import ModelConfig

BOS_ID, EOS_ID = 1, 2


class Skip(Exception):
    """This contender cannot run this workload here (the reason is reported)."""


def _name(base: str, dtype: str, device: str) -> str:
    """'torch' for the CPU float32 contender (the reference of every CPU ratio), else
    'torch-cuda-float16' and so on."""
    return base if (dtype, device) == ("float32", "cpu") else f"{base}-{device}-{dtype}"


class Contender:
    name: str
    dtype = "float32"
    device = "cpu"

    def prepare(self, cfg: ModelConfig, params: Mapping[str, np.ndarray]) -> None:
        self.cfg, self.params = cfg, params

    def forward(self, src: np.ndarray | None, tgt: np.ndarray) -> object:
        """The logits, computed to completion and left where they were computed."""
        raise Skip("no teacher-forced forward")

    def finish(self, output: object) -> object:
        """The output once the device has computed it (the clock stops after this)."""
        return output

    def to_host(self, output: object) -> object:
        """The output copied into host memory (timed apart from the forward on a GPU)."""
        return np.asarray(output)

    def generate(self, src: np.ndarray, max_new_tokens: int) -> np.ndarray:
        raise Skip("no greedy generation")

    def step(self, src: np.ndarray | None, past_len: int) -> Callable[[], None]:
        raise Skip("no cached decode step")

    def _generation_arguments(self, src: np.ndarray) -> dict:
        if self.cfg.has_encoder:
            return {"src_ids": src, "bos_id": BOS_ID}
        return {"prompt_ids": src}

    def _cached_step(self, src: np.ndarray, past_len: int, *,
                     finish: Callable[[object], object] = lambda result: result) -> Callable[[], object]:
        """For a model with start_cache and decode_step (impl_torch, impl_jax, the onnxruntime
        runner): prefill past_len positions, then return one more step to time. The cache is
        preallocated with room for exactly past_len + 1; every timed call continues the same
        prefilled cache (where the cache is written in place, a rewind to the same position)."""
        batch = len(src)
        source = src if self.cfg.has_encoder else None
        cache = self.model.start_cache(batch, past_len + 1, source)
        _, cache = self.model.decode_step(cache, self._prefix(batch, past_len))
        token = self._prefix(batch, 1)
        return lambda: finish(self.model.decode_step(cache, token))

    def _prefix(self, batch: int, past_len: int) -> np.ndarray:
        return np.full((batch, past_len), 3 % self.cfg.tgt_vocab_size, dtype=np.int64)


class Golden(Contender):
    def __init__(self, dtype: str):
        self.dtype, self.name = dtype, f"numpy-{dtype}"

    def prepare(self, cfg, params):
        super().prepare(cfg, params)
        self.cast = golden.cast_params(cfg, params, np.dtype(self.dtype))

    def forward(self, src, tgt):
        return golden.forward(self.cfg, self.params, src, tgt, dtype=np.dtype(self.dtype))

    def generate(self, src, max_new_tokens):
        return golden.greedy_generate(self.cfg, self.params, **self._generation_arguments(src), eos_id=EOS_ID,
                                      max_new_tokens=max_new_tokens, dtype=np.dtype(self.dtype))

    def step(self, src, past_len):
        batch = len(src)
        cache = golden.start_cache(self.cfg, self.cast, batch, src if self.cfg.has_encoder else None)
        _, cache = golden.decode_step(self.cfg, self.cast, cache, self._prefix(batch, past_len))
        token = self._prefix(batch, 1)
        return lambda: golden.decode_step(self.cfg, self.cast, cache, token)


class TorchEager(Contender):
    base = "torch"

    def __init__(self, dtype: str = "float32", device: str = "cpu"):
        self.dtype, self.device = dtype, device
        self.name = _name(self.base, dtype, device)

    def prepare(self, cfg, params):
        super().prepare(cfg, params)
        import torch

        from impl_torch import Transformer

        if self.device == "cuda" and not torch.cuda.is_available():
            raise Skip("no CUDA device here")
        self.torch = torch
        self.model = Transformer.from_params(cfg, params, dtype=getattr(torch, self.dtype), device=self.device)

    def finish(self, output):
        if self.device == "cuda":
            self.torch.cuda.synchronize()  # kernels are queued: the clock waits for them
        return output

    def to_host(self, output):
        return output.cpu()

    def forward(self, src, tgt):
        with self.torch.inference_mode():
            return self.finish(self.model(src, tgt))

    def generate(self, src, max_new_tokens):
        return self.model.greedy_generate(**self._generation_arguments(src), eos_id=EOS_ID,
                                          max_new_tokens=max_new_tokens).cpu().numpy()

    def step(self, src, past_len):
        return self._cached_step(src, past_len, finish=self.finish)


class TorchNoCache(TorchEager):
    """Generation without a cache: every step runs the whole prefix again (the curve beside the cache's)."""

    base = "torch-no-cache"

    def forward(self, src, tgt):
        raise Skip("the same forward as torch")

    def generate(self, src, max_new_tokens):
        raise Skip("timed per step only")

    def step(self, src, past_len):
        prefix = self._prefix(len(src), past_len + 1)
        source = src if self.cfg.has_encoder else None
        return lambda: TorchEager.forward(self, source, prefix)


class TorchCompiled(TorchEager):
    """torch.compile of the forward; on a GPU also mode="reduce-overhead" (CUDA graphs)."""

    def __init__(self, dtype: str = "float32", device: str = "cpu", mode: str = "default"):
        self.mode = mode
        self.base = "torch.compile" if mode == "default" else f"torch.compile-{mode}"
        super().__init__(dtype, device)

    def prepare(self, cfg, params):
        super().prepare(cfg, params)
        model = self.model

        def logits(src, tgt, src_keep, tgt_keep):
            memory = model.encode(src, src_keep) if model.cfg.has_encoder else None
            return model.output_logits(model.decode(tgt, tgt_keep, memory, src_keep))

        self.compiled = self.torch.compile(logits, mode=self.mode)
        if self.device == "cuda":
            from impl_torch import compiled_step

            self.step_body = compiled_step(mode=self.mode)

    def forward(self, src, tgt):
        torch = self.torch
        # tensors under no_grad: Dynamo does not trace NumPy inputs under inference_mode
        tgt_t = torch.as_tensor(tgt, device=self.device)
        src_t = torch.as_tensor(src, device=self.device) if src is not None else None
        with torch.no_grad():
            return self.finish(self.compiled(src_t, tgt_t, None if src_t is None else src_t != self.cfg.pad_id,
                                             tgt_t != self.cfg.pad_id))

    def generate(self, src, max_new_tokens):
        if self.device != "cuda":
            raise Skip("the compiled decode step is timed on a GPU, where its point is CUDA graphs; "
                       "torch eager's loop is timed here")
        return self.model.greedy_generate(**self._generation_arguments(src), eos_id=EOS_ID,
                                          max_new_tokens=max_new_tokens, step=self.step_body).cpu().numpy()

    def step(self, src, past_len):
        raise Skip("one step is timed in torch eager; the compiled step is timed inside generation")


class JaxJit(Contender):
    base = "jax"

    def __init__(self, dtype: str = "float32", device: str = "cpu"):
        self.dtype, self.device = dtype, device
        self.name = _name(self.base, dtype, device)

    def prepare(self, cfg, params):
        super().prepare(cfg, params)
        import jax

        from impl_jax import Transformer

        platform = "gpu" if self.device == "cuda" else "cpu"
        try:
            self.placement = jax.default_device(jax.devices(platform)[0])
        except RuntimeError:
            raise Skip(f"JAX sees no {platform} device here") from None
        with self.placement:
            self.model = Transformer.from_params(cfg, params, dtype=self.dtype)

    def finish(self, output):
        return output.block_until_ready()  # JAX dispatches asynchronously on every device

    def forward(self, src, tgt):
        with self.placement:
            return self.finish(self.model(src, tgt))

    def generate(self, src, max_new_tokens):
        with self.placement:
            return np.asarray(self.model.greedy_generate(**self._generation_arguments(src), eos_id=EOS_ID,
                                                         max_new_tokens=max_new_tokens))

    def step(self, src, past_len):
        with self.placement:
            step = self._cached_step(src, past_len, finish=lambda result: self.finish(result[0]))

        def placed_step():
            with self.placement:
                return step()
        return placed_step


class OnnxRuntime(Contender):
    def __init__(self, dtype: str, device: str):
        self.dtype, self.device = dtype, device
        self.name = f"onnxruntime-{device}-{dtype}"

    def prepare(self, cfg, params):
        super().prepare(cfg, params)
        from export.cache import exported
        from export.runner import OnnxTransformer, cuda_available

        if self.device == "cuda" and not cuda_available():
            raise Skip("no CUDA provider here")
        self.model = OnnxTransformer(exported(cfg, params, dtype=self.dtype), device=self.device)

    def forward(self, src, tgt):
        # onnxruntime's run waits for the provider's stream before it returns: nothing to finish
        return self.model.forward_on_device(src, tgt)

    def to_host(self, output):
        return output.numpy()

    def generate(self, src, max_new_tokens):
        return self.model.greedy_generate(**self._generation_arguments(src), eos_id=EOS_ID,
                                          max_new_tokens=max_new_tokens)

    def step(self, src, past_len):
        return self._cached_step(src, past_len)


class OnnxRuntimeQuantized(OnnxRuntime):
    """Our float32 export quantized by onnxruntime (export.quantize, SPEC §15.1) on the CPU. Its tokens
    are judged against the golden on the weights it stores (`judged_on`), not the float golden's;
    a dynamic scheme's (int8 activations) are not judged, only where they part from the float ones."""

    def __init__(self, scheme):
        super().__init__("float32", "cpu")
        self.scheme = self.stored_as = scheme  # stored_as: the bytes a decode step reads (the roofline's)
        self.name = f"onnxruntime-{scheme.name}"
        self.judged_on = None  # (cfg, params) the golden runs on to judge the tokens; None: not judged

    def prepare(self, cfg, params):
        Contender.prepare(self, cfg, params)
        from export.quantize import deployed_weights, graphs_of, quantized_export
        from export.runner import OnnxTransformer

        directory = quantized_export(cfg, params, self.scheme)
        self.model = OnnxTransformer(directory, device="cpu")
        if not self.scheme.dynamic:
            deployed = deployed_weights(cfg, params, graphs_of(cfg, params, directory))
            self.judged_on = (deployed.cfg, deployed.params)


class OnnxRuntimeCudaGraph(OnnxRuntime):
    """The same export's generation on fixed device buffers, each step a replayed CUDA graph and
    the argmax on the device (export.fixed_greedy); its forward and single step are
    onnxruntime-cuda-<dtype>'s."""

    def __init__(self, dtype: str):
        super().__init__(dtype, "cuda")
        self.name = f"onnxruntime-cuda-graph-{dtype}"

    def prepare(self, cfg, params):
        super().prepare(cfg, params)
        from export.fixed_greedy import FixedBufferGreedy

        self.loop = FixedBufferGreedy(self.model)

    def forward(self, src, tgt):
        raise Skip("the forward graph is onnxruntime-cuda's, timed there")

    def generate(self, src, max_new_tokens):
        return self.loop.generate(**self._generation_arguments(src), eos_id=EOS_ID, max_new_tokens=max_new_tokens)

    def step(self, src, past_len):
        raise Skip("one step is timed in onnxruntime-cuda; the replayed step inside generation")


def _written_as_huggingface(contender: Contender, cfg: ModelConfig, params: Mapping[str, np.ndarray], prefix: str,
                            unsupported: Callable[[str], str | None], no_family: str) -> Path:
    """The weights written as a Hugging Face directory (folder/source) in the contender's own
    temporary folder, for a peer that reads nothing else; Skip where the writer knows no family
    for the config (`no_family` says whose) or `unsupported(family)` gives a reason."""
    from importers.huggingface_writer import family_of, to_huggingface
    from spec.errors import ConfigError

    try:
        family = family_of(cfg)
    except ConfigError as error:
        raise Skip(f"{no_family} ({error})") from None
    if (reason := unsupported(family)) is not None:
        raise Skip(reason)
    contender.directory = tempfile.TemporaryDirectory(prefix=prefix)
    folder = Path(contender.directory.name)
    to_huggingface(cfg, params, folder / "source", bos_id=BOS_ID, eos_id=EOS_ID)
    return folder


class CTranslate2(Contender):
    """CTranslate2 from the same weights: its Translator for an encoder-decoder, its Generator
    for a Llama- or Qwen2-family decoder through our mapping (benchmarks.ctranslate2_peer), and
    for the other decoders its own converter on the weights written as a Hugging Face directory
    (the ctranslate2 column's path: what its loader leaves out shows as different tokens)."""

    name = "ctranslate2"
    runner = None

    def __init__(self, compute_type: str = "float32"):
        self.compute_type = compute_type
        if compute_type != "float32":  # CTranslate2's int8 compute types: its weights and activations int8
            from spec.quantization import CTRANSLATE2_INT8

            self.name = f"ctranslate2-{compute_type}"
            self.judged_on = None  # int8 products of activations, which no golden computes: the cost only
            # what a decode step reads: a byte per weight element and one float32 scale per row
            self.stored_as = CTRANSLATE2_INT8[compute_type]

    def prepare(self, cfg, params):
        super().prepare(cfg, params)
        try:
            import ctranslate2
        except ImportError as error:
            raise Skip(f"not installed ({error})") from None
        from benchmarks.ctranslate2_peer import convert, convert_decoder, unsupported_reason

        reason = unsupported_reason(cfg)
        if reason and not cfg.has_encoder:
            return self._own_converter(cfg, params, reason)
        if reason:
            raise Skip(reason)
        self.directory = tempfile.TemporaryDirectory(prefix="rosetta-ct2-")
        if cfg.has_encoder:
            convert(cfg, params, self.directory.name, BOS_ID, EOS_ID)
            self.translator = ctranslate2.Translator(self.directory.name, device="cpu", compute_type=self.compute_type)
        else:
            convert_decoder(cfg, params, self.directory.name, BOS_ID, EOS_ID)
            self.generator = ctranslate2.Generator(self.directory.name, device="cpu", compute_type=self.compute_type)

    def _own_converter(self, cfg, params, why_not_ours: str) -> None:
        from conformance.backends.ctranslate2_backend import (CTranslate2Runner, convert_model,
                                                              ctranslate2_unsupported_reason)

        folder = _written_as_huggingface(self, cfg, params, "rosetta-ct2-", ctranslate2_unsupported_reason,
                                         f"{why_not_ours}; nor a family its converter reads")
        try:
            self.runner = CTranslate2Runner(convert_model(folder / "source", cfg, folder), cfg, self.compute_type)
        except NotSupported as reason:
            raise Skip(str(reason)) from None

    def forward(self, src, tgt):
        raise Skip("CTranslate2 exposes no teacher-forced logits")

    def generate(self, src, max_new_tokens):
        from benchmarks.ctranslate2_peer import greedy, greedy_decoder

        if (src == self.cfg.pad_id).any():
            raise Skip("CTranslate2 takes unpadded rows; the benchmark's sources are unpadded")
        if self.runner is not None:
            return self.runner.greedy_batch(src, max_new_tokens, EOS_ID)
        if self.cfg.has_encoder:
            return greedy(self.translator, self.cfg, src, max_new_tokens)
        return greedy_decoder(self.generator, self.cfg, src, max_new_tokens, EOS_ID)


class OnnxRuntimeGenai(Contender):
    """onnxruntime-genai's builder and generator on the same weights, written as a Hugging Face
    directory (the builder reads nothing else): its own graph, KV cache and greedy search."""

    name = "onnxruntime-genai"

    def prepare(self, cfg, params):
        super().prepare(cfg, params)
        try:
            import onnxruntime_genai  # noqa: F401
        except ImportError as error:
            raise Skip(f"not installed ({error})") from None
        from conformance.backends.genai_backend import GenaiRunner, build_model, genai_unsupported_reason

        folder = _written_as_huggingface(self, cfg, params, "rosetta-genai-",
                                         lambda family: genai_unsupported_reason(cfg, family),
                                         "the builder reads a directory of the families the writer knows")
        self.runner = GenaiRunner(build_model(folder / "source", cfg, folder), cfg)

    def forward(self, src, tgt):
        return self.runner.logits(tgt)

    def generate(self, src, max_new_tokens):
        if (src == self.cfg.pad_id).any():
            raise Skip("onnxruntime-genai reads its mask as a length; the benchmark's prompts are unpadded")
        return self.runner.greedy_batch(src, max_new_tokens, EOS_ID)


def contenders(devices: tuple[str, ...] = ("cpu",), quantized: tuple = ()) -> list[Contender]:
    """Every contender on each device asked for. On the CPU: golden first, torch eager (the
    reference of every CPU ratio) second, onnxruntime's float and quantized (the schemes of
    `quantized`, spec.quantization.QuantizationScheme) exports, the outside peers (CTranslate2,
    onnxruntime-genai) last. On a GPU: every framework at float16 (torch eager first, the reference
    of the GPU ratios), float32 and bfloat16 where it runs them."""
    chosen: list[Contender] = []
    if "cpu" in devices:
        chosen += [Golden("float64"), TorchEager(), Golden("float32"), TorchNoCache(), TorchCompiled(), JaxJit(),
                   OnnxRuntime("float32", "cpu"), OnnxRuntime("float16", "cpu"),
                   *(OnnxRuntimeQuantized(scheme) for scheme in quantized), CTranslate2(),
                   *((CTranslate2("int8"), CTranslate2("int8_float32")) if quantized else ()), OnnxRuntimeGenai()]
    if "cuda" in devices:
        chosen += [TorchEager("float16", "cuda"), TorchEager("bfloat16", "cuda"), TorchEager("float32", "cuda"),
                   TorchCompiled("float16", "cuda"), TorchCompiled("float16", "cuda", mode="reduce-overhead"),
                   JaxJit("float16", "cuda"), JaxJit("bfloat16", "cuda"), JaxJit("float32", "cuda"),
                   OnnxRuntime("float16", "cuda"), OnnxRuntimeCudaGraph("float16"), OnnxRuntime("float32", "cuda")]
    return chosen
