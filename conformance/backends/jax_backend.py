"""Harness adapters for impl_jax: ``jax`` (jax.nn.dot_product_attention) and ``jax-math`` (the
explicit softmax(QKᵀ/√d_k)V). Imported only when asked for.

dtype 'float64' runs inside JAX's x64 mode, scoped to that runner's calls; 'tf32' is float32
with JAX's default matmul precision on a GPU (TF32 on NVIDIA), every other dtype uses 'highest'.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping
from pathlib import Path
import jax
import jax.numpy as jnp
import numpy as np

from flax import nnx

from conformance.backends.module_runner import FrameworkBackend, ModuleRunner
from conformance.cases import attention_queries, record_steps
from impl_jax import Transformer, attention_path, on_device, scaled_dot_product_attention, view_mask
from impl_jax.model import recorded_routers, training_loss
from spec import ModelConfig
from spec.training import loss_scaling, master_dtype

NATIVE_PATH, EXPLICIT_PATH = "jax.nn.dot_product_attention", "explicit"
JAX_DTYPES = {"float64": "float64", "float32": "float32", "tf32": "float32", "float16": "float16",
              "bfloat16": "bfloat16"}


def use_persistent_compilation_cache() -> str | None:
    """Keep XLA's compiled programs on disk between runs: a cold catalogue column spends ~20 s
    compiling one program per operation and shape, a warm one ~7 s. Left alone when the user
    configured a cache already; ROSETTA_JAX_CACHE=0 turns it off, ROSETTA_JAX_CACHE=DIR moves it."""
    setting = os.environ.get("ROSETTA_JAX_CACHE", "")
    if setting == "0" or jax.config.jax_compilation_cache_dir:
        return jax.config.jax_compilation_cache_dir
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    directory = Path(setting) if setting else base / "transformer-rosetta" / "jax"
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None  # an unwritable home: compile every time rather than fail
    jax.config.update("jax_compilation_cache_dir", str(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    return str(directory)


def _platform_devices(platform: str) -> list:
    try:
        return jax.devices(platform)
    except RuntimeError:  # no such backend on this machine
        return []


class JaxRunner(ModuleRunner):
    def __init__(self, cfg: ModelConfig, params: Mapping[str, np.ndarray], dtype: str, device: str, attention: str):
        self.cfg, self.attention = cfg, attention
        self.x64 = dtype == "float64"
        self.precision = "default" if dtype == "tf32" else "highest"
        self.device = _platform_devices("gpu" if device == "cuda" else "cpu")[0]
        with self._scope():
            self.model = Transformer.from_params(cfg, params, dtype=JAX_DTYPES[dtype], attention=attention,
                                                 precision=self.precision)
        self.dtype, self.precision = self.model.dtype, self.model.precision  # half dtypes use 'default'
        self.params, self.dtype_name = params, dtype  # a half-precision column trains from them in float32
        self._splits: dict[str, tuple] = {}  # gradient cases' owners, split once (_vjp)

    def routing_log(self, forced=None, forced_weights=None):
        """The model's mixture-of-experts routing, logged, or the golden's replayed (SPEC §5.14)."""
        return self.model.routing_log(forced, forced_weights)

    # converted on the host and put on the device (impl_jax.on_device): jnp.asarray compiles a
    # program per shape
    def _float(self, x):
        if isinstance(x, jax.Array):  # already the run's (a traced value, in a gradient case)
            return x
        return None if x is None else on_device(x, self.dtype)

    def _array(self, x):
        return None if x is None else on_device(x)

    def _ids(self, x):
        return on_device(x, np.int32)

    def attention_path(self, sublayer: str, inputs: Mapping) -> str:
        """Which attention the case ran: 'jax.nn.dot_product_attention', or 'explicit (why)', the
        program jax-math runs, where the native primitive cannot serve this dtype and device."""
        platform, queries = self.device.platform, attention_queries(sublayer, inputs)
        capped = self.cfg.attention_softcap is not None
        taken = {attention_path(self.dtype, platform, n, self.attention, capped, self.cfg.attention_sinks)
                 for n in queries}
        names = [NATIVE_PATH if path == "sdpa" else EXPLICIT_PATH + (f" ({why})" if why else "") for path, why in taken]
        return " and ".join(sorted(names))

    def _attention(self, q, k, v, mask, sinks=None):
        mask = view_mask(mask, q.shape[0], q.shape[1], q.shape[2], k.shape[2])
        return scaled_dot_product_attention(q, k, v, mask, self.attention, self.precision, self.cfg.score_scale,
                                            self.cfg.attention_softcap, sinks)

    def _training_loss(self, model, inputs):
        routed: list = []
        if model is not self.model:  # a gradient's copy runs op by op: its routing is recorded as it runs
            with recorded_routers() as routed:
                logits = self._logits(model, inputs)
        elif self.cfg.moe is not None and self.cfg.moe.load_balancing:  # the compiled program gives it as outputs
            logits, routed = model.routed_call(inputs["src_ids"], inputs["tgt_ids"], inputs.get("dropout_masks"))
        else:  # the forward cells' compiled program, not one more
            logits = self._logits(model, inputs)
        return training_loss(self.cfg, logits, inputs["targets"], inputs["tgt_ids"], routed)

    def _vjp(self, forward, floats, d_out, owner):
        cotangent = None if np.ndim(d_out) == 0 else self._float(d_out)
        # The owner is split into its structure and its Params once; jax.grad differentiates the
        # Params, merged into a copy of the owner that stands in for it (nnx.grad would split the
        # whole model again at every call, ~0.1 s of a tiny model's ~0.2 s). Every entry point
        # runs eagerly under it, op by op: no per-case compilation.
        if owner is not None and owner not in self._splits:
            self._splits[owner] = nnx.split(self._module(owner) if owner else self.model, nnx.Param, ...)
        structure, params, rest = self._splits[owner] if owner is not None else (None, {}, None)

        def pulled_back(params, tensors):
            module = self.model if owner is None else nnx.merge(structure, params, rest)
            if owner:
                self._standing_in = {owner: module}
            try:
                out = forward(self.model if owner else module, tensors)
            finally:
                self._standing_in = {}
            # ⟨forward, d_out⟩: its gradient is the VJP, the cotangent reaching the output in the
            # output's dtype as a pullback's would
            return (out if cotangent is None else (out * cotangent.astype(out.dtype)).sum()), out

        (param_grads, d_inputs), out = jax.grad(pulled_back, argnums=(0, 1), has_aux=True)(params, floats)
        return out, d_inputs, _by_name(param_grads) if owner is not None else {}

    def train(self, sublayer, inputs):
        """A training case (conformance/cases.py): optax's steps (impl_jax.training) on a copy of
        the model, its parameters, gradients and Adam's moments read back by canonical name."""
        from impl_jax import training as jax_training  # optax: only where training is asked for

        training = inputs["training"]

        def canonical(tree):
            return {name: self._to_numpy(value) for name, value in _by_name(tree).items()}

        def step(src_ids, tgt_ids, targets, dropout_masks):
            if (log := model.routing_log_in_use()) is not None:  # a replayed run takes each step's routing at
                log.before_step(lambda: canonical(nnx.state(model, nnx.Param)))  # the parameters it starts from
            loss, grads, run["state"] = jax_training.train_step(self.cfg, model, optimizer, run["state"], src_ids,
                                                                tgt_ids, targets, dropout_masks, mixed)
            adam = jax_training.adam_moments(run["state"])
            return {"loss": loss, "gradients": canonical(grads), "first_moment": canonical(adam.mu),
                    "second_moment": canonical(adam.nu), "params": canonical(nnx.state(model, nnx.Param))}

        with self._gradient_scope():
            mixed = None
            if master_dtype(self.dtype_name) != self.dtype_name:  # mixed precision (SPEC §14.2): the case's
                # parameters as float32 master weights, the column's model the half-precision copy
                model = Transformer.from_params(self.cfg, self.params, dtype=master_dtype(self.dtype_name),
                                                attention=self.attention)
                mixed = jax_training.MixedPrecision(nnx.clone(self.model), loss_scaling(self.dtype_name))
            else:
                model = nnx.clone(self.model)
            optimizer = jax_training.make_optimizer(self.cfg, training)
            run = {"state": jax_training.start(model, optimizer)}
            return record_steps(inputs, step)

    def _concatenate(self, arrays):
        return jnp.concatenate(arrays, axis=1)

    def _to_numpy(self, out) -> np.ndarray:
        # widened on the host: a bfloat16 -> float32 cast on the device would be one more XLA
        # program per output shape. (NumPy does not count ml_dtypes' bfloat16 as np.floating.)
        out = np.asarray(out)
        return out.astype(np.float64) if jnp.issubdtype(out.dtype, jnp.floating) else out.astype(np.int64)

    @contextlib.contextmanager
    def _scope(self):
        with jax.enable_x64(self.x64), jax.default_device(self.device), jax.default_matmul_precision(self.precision):
            yield


def _by_name(state) -> dict:
    """A tree of the model's Params (or of their gradients or moments) by canonical name: Flax's
    kernel and embedding are the spec's weight."""
    named = {}
    for path, variable in nnx.to_flat_state(state):
        *module, leaf = (str(part) for part in path)
        named[".".join([*module, "weight" if leaf in ("kernel", "embedding") else leaf])] = \
            variable.get_value() if hasattr(variable, "get_value") else variable
    return named


class JaxBackend(FrameworkBackend):
    """impl_jax with one attention path on every device JAX sees ('cuda' is JAX's gpu platform)."""

    attention = "sdpa"
    name = "jax"
    # jax and jax-math compile the same programs but for attention: the parallel harness runs a
    # dtype's two columns in one worker, one after the other (conformance.executors.column_groups)
    program_family = "jax"

    def __init__(self):
        use_persistent_compilation_cache()

    def devices(self) -> list[str]:
        return ["cpu"] + (["cuda"] if _platform_devices("gpu") else [])

    def device_name(self, device: str) -> str:
        return _platform_devices("gpu" if device == "cuda" else "cpu")[0].device_kind

    def load(self, cfg: ModelConfig, params: Mapping[str, np.ndarray], dtype: str, device: str) -> JaxRunner:
        return JaxRunner(cfg, params, dtype, device, self.attention)


class JaxMathBackend(JaxBackend):
    attention = "math"
    name = "jax-math"
