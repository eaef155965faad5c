"""Harness adapters for impl_torch: ``torch`` (the F.scaled_dot_product_attention path, what users
run) and ``torch-math`` (the explicit softmax(QKᵀ/√d_k)V path). Imported only when asked for."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Mapping
import numpy as np
import torch

from conformance.backends.module_runner import FrameworkBackend, ModuleRunner
from conformance.cases import record_steps
from impl_torch import training as torch_training
from impl_torch import Transformer, scaled_dot_product_attention, view_mask
from impl_torch.model import recorded_routers, training_loss
from impl_torch.model import _linear_weight_names
from spec import ModelConfig
from spec.training import loss_scaling, master_dtype

TORCH_DTYPES = {"float64": torch.float64, "float32": torch.float32, "tf32": torch.float32,
                "float16": torch.float16, "bfloat16": torch.bfloat16}


@contextlib.contextmanager
def matmul_precision(precision: str):
    """float32 matmuls in full float32 ('highest') or TF32 ('high'); PyTorch's own default is
    'highest', but a user's process may have changed it, so every run states it."""
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(previous)


class TorchRunner(ModuleRunner):
    def __init__(self, cfg: ModelConfig, params: Mapping[str, np.ndarray], dtype: str, device: str, attention: str):
        self.cfg, self.device, self.attention = cfg, torch.device(device), attention
        self.dtype = TORCH_DTYPES[dtype]
        self.precision = "high" if dtype == "tf32" else "highest"
        self.model = Transformer.from_params(cfg, params, dtype=self.dtype, device=device, attention=attention)
        self.params, self.dtype_name = params, dtype  # a half-precision column trains from them in float32

    def _float(self, x):
        if isinstance(x, torch.Tensor):  # already the run's: a gradient case's leaf
            return x
        return None if x is None else torch.as_tensor(np.asarray(x)).to(self.device, self.dtype)

    def _array(self, x):
        return None if x is None else torch.as_tensor(np.asarray(x)).to(self.device)

    def _ids(self, x):
        return torch.as_tensor(np.asarray(x), dtype=torch.long, device=self.device)

    def routing_log(self, forced=None, forced_weights=None):
        """The model's mixture-of-experts routing, logged, or the golden's replayed (SPEC §5.14)."""
        return self.model.routing_log(forced, forced_weights)

    def _attention(self, q, k, v, mask, sinks=None):
        mask = view_mask(mask, q.shape[0], q.shape[1], q.shape[2], k.shape[2])
        return scaled_dot_product_attention(q, k, v, mask, self.attention, self.cfg.score_scale,
                                            self.cfg.attention_softcap, sinks)

    def _training_loss(self, model, inputs):
        with recorded_routers() as routed:  # what a mixture of experts' load-balancing loss reads
            logits = self._logits(model, inputs)
        return training_loss(self.cfg, logits, inputs["targets"], inputs["tgt_ids"], routed)

    def _vjp(self, forward, floats, d_out, owner):
        leaves = {name: x.detach().requires_grad_() for name, x in floats.items()}
        transposed = _linear_weight_names(self.model)
        params = {} if owner is None else {
            name: value for name, value in self.model.named_parameters() if owner == "" or name.startswith(owner + ".")}
        with torch.enable_grad():
            out = forward(self.model, leaves)
            cotangent = None if out.dim() == 0 else self._float(d_out)
            grads = torch.autograd.grad(out, [*leaves.values(), *params.values()], cotangent, allow_unused=True)
        grads = [torch.zeros_like(x) if g is None else g for g, x in zip(grads, [*leaves.values(), *params.values()])]
        d_inputs = dict(zip(leaves, grads[:len(leaves)]))
        relative = {}
        for (name, _), grad in zip(params.items(), grads[len(leaves):]):
            relative[name[len(owner) + 1:] if owner else name] = grad.T if name in transposed else grad
        return out.detach(), d_inputs, relative

    def train(self, sublayer, inputs):
        """A training case (conformance/cases.py): torch.optim's steps (impl_torch.training) on a
        copy of the model, its parameters, gradients and moments read back by canonical name."""
        cfg, training = self.cfg, inputs["training"]
        mixed = None
        if master_dtype(self.dtype_name) != self.dtype_name:  # mixed precision (SPEC §14.2): float32 master
            # weights from the case's parameters, the caller's routing log (replayed routing) attached
            mixed = torch_training.MixedPrecision(self.dtype, loss_scaling(self.dtype_name), self.device.type)
            model = Transformer.from_params(cfg, self.params, dtype=TORCH_DTYPES[master_dtype(self.dtype_name)],
                                            device=self.device, attention=self.attention)
            model.attach_routing_log(self.model.routing_log_in_use())
        else:  # the copy's MoE layers keep the caller's routing log, not a copy of it
            logs = {id(module.log): module.log for module in self.model.modules()
                    if getattr(module, "log", None) is not None}
            model = copy.deepcopy(self.model, memo=logs)
        optimizer, schedule = torch_training.make_optimizer(model, training)
        transposed = _linear_weight_names(model)

        def canonical(tensors):
            # copies: the optimizer updates parameters and moments in place, and a float64 CPU
            # tensor's numpy() is a view of it
            return {name: self._to_numpy((t.T if name in transposed else t).detach()).copy() for name, t in tensors.items()}

        log = model.routing_log_in_use()

        def step(src_ids, tgt_ids, targets, dropout_masks):
            if log is not None:  # a replayed run takes each step's routing at the parameters it starts from
                log.before_step(lambda: canonical(dict(model.named_parameters())))
            loss, grads = torch_training.train_step(cfg, training, model, optimizer, schedule, src_ids, tgt_ids, targets,
                                                    dropout_masks, mixed)
            named = dict(model.named_parameters())
            # (a parameter the step never reached has no state: its moments are zero)
            moments = {key: {name: optimizer.state[p].get(key, torch.zeros_like(p)) for name, p in named.items()}
                       for key in ("exp_avg", "exp_avg_sq")}
            return {"loss": loss, "gradients": canonical(grads), "first_moment": canonical(moments["exp_avg"]),
                    "second_moment": canonical(moments["exp_avg_sq"]), "params": canonical(named)}

        with matmul_precision(self.precision):
            return record_steps(inputs, step)

    def _concatenate(self, arrays):
        return torch.cat(arrays, dim=1)

    def _to_numpy(self, out) -> np.ndarray:
        if out.is_floating_point():
            return out.to("cpu", torch.float64).numpy()
        return out.cpu().numpy()

    @contextlib.contextmanager
    def _scope(self):
        with torch.inference_mode(), matmul_precision(self.precision):
            yield

    def _gradient_scope(self):
        return matmul_precision(self.precision)


class TorchBackend(FrameworkBackend):
    """impl_torch with one attention path on every device torch sees."""

    attention = "sdpa"
    name = "torch"

    def devices(self) -> list[str]:
        return ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])

    def device_name(self, device: str) -> str:
        return torch.cuda.get_device_name(0) if device == "cuda" else "cpu"

    def load(self, cfg: ModelConfig, params: Mapping[str, np.ndarray], dtype: str, device: str) -> TorchRunner:
        return TorchRunner(cfg, params, dtype, device, self.attention)


class TorchMathBackend(TorchBackend):
    attention = "math"
    name = "torch-math"
