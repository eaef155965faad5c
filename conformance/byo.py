"""Bring your own implementation: check a Transformer you wrote against the golden.

Two pieces, both framework-free:

- ``map_parameters``: the canonical parameters (spec.param_shapes) renamed and reshaped into
  your model's own names — one mapping, every shape checked, and a readable diff of keys on
  any mismatch (canonical names nobody consumed, parameters of yours nobody filled, shapes).
- ``CustomBackend``: a harness backend made of a builder (canonical params -> your model) and
  one hook per catalogue sublayer you implement (``hook(model, inputs) -> array``). Sublayers
  without a hook are reported as skipped with that reason, never as passed.

Worked example: docs/bring-your-own.md and examples/nanogpt_style.py.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from conformance.adapter import NotSupported
from conformance.cases import SUBLAYERS
from spec import ModelConfig, WeightsError

# How a parameter of yours is made from canonical ones:
#   "copy"       the canonical array as it is                      (one name)
#   "transpose"  its transpose: [in, out] -> [out, in], as nn.Linear stores weights   (one name)
#   "stack"      the transposes of several, stacked along rows: fused q/k/v   (several names)
TRANSFORMS = ("copy", "transpose", "stack")


def map_parameters(params: Mapping[str, np.ndarray], mapping: Mapping[str, tuple[str | Sequence[str], str]],
                   own_shapes: Mapping[str, tuple[int, ...]]) -> dict[str, np.ndarray]:
    """Canonical params -> your parameters, by ``mapping[your_name] = (canonical name(s), transform)``.

    ``own_shapes`` are your model's parameter shapes (e.g. from its state_dict). Raises one
    WeightsError listing every difference: '- canonical X is not used', '+ your Y is not
    filled', '~ Y: shape ... from mapping, model has ...', and bad mapping entries."""
    problems: list[str] = []
    used: set[str] = set()
    out: dict[str, np.ndarray] = {}
    for own_name, (source, transform) in mapping.items():
        names = [source] if isinstance(source, str) else list(source)
        missing = [name for name in names if name not in params]
        if transform not in TRANSFORMS or (transform != "stack" and len(names) != 1):
            problems.append(f"! {own_name}: transform {transform!r} with {len(names)} name(s) "
                            f"(use copy or transpose with one name, stack with several)")
            continue
        if missing:
            problems.append(f"! {own_name}: maps from unknown canonical name(s) {', '.join(missing)}")
            continue
        used.update(names)
        if transform == "copy":
            value = params[names[0]]
        elif transform == "transpose":
            value = params[names[0]].T
        else:
            value = np.concatenate([params[name].T for name in names], axis=0)
        if own_name not in own_shapes:
            problems.append(f"+ {own_name} is not a parameter of your model")
        elif tuple(value.shape) != tuple(own_shapes[own_name]):
            problems.append(f"~ {own_name}: shape {list(value.shape)} from the mapping, model has "
                            f"{list(own_shapes[own_name])}")
        out[own_name] = np.ascontiguousarray(value)
    problems += [f"- canonical {name} is not used by the mapping" for name in params if name not in used]
    problems += [f"+ your {name} is not filled by the mapping" for name in own_shapes if name not in mapping]
    if problems:
        raise WeightsError(f"parameter mapping does not fit ({len(problems)} difference(s)):\n  "
                           + "\n  ".join(problems))
    return out


class CustomBackend:
    """A harness backend around your own implementation.

    build(cfg, params, dtype, device) -> your model, from canonical float32 NumPy params.
    hooks: {sublayer: hook(model, inputs) -> array-like}, sublayers and inputs as in
    conformance/cases.py. Register it with conformance.adapter.register_backend(name, lambda: backend).
    """

    def __init__(self, name: str, build: Callable[[ModelConfig, Mapping[str, np.ndarray], str, str], Any],
                 hooks: Mapping[str, Callable[[Any, Mapping[str, Any]], Any]], *,
                 dtypes: Sequence[str] = ("float32",), devices: Sequence[str] = ("cpu",),
                 to_numpy: Callable[[Any], np.ndarray] = np.asarray):
        unknown = sorted(set(hooks) - set(SUBLAYERS))
        if unknown:
            raise ValueError(f"hooks for unknown sublayer(s) {', '.join(unknown)}; known: {', '.join(SUBLAYERS)}")
        self.name, self.build, self.hooks = name, build, dict(hooks)
        self.dtypes, self.device_list, self.to_numpy = tuple(dtypes), list(devices), to_numpy

    def availability(self) -> str | None:
        return None

    def devices(self) -> list[str]:
        return list(self.device_list)

    def supports(self, dtype: str, device: str) -> str | None:
        return None if dtype in self.dtypes else f"{self.name} runs {', '.join(self.dtypes)} only"

    def load(self, cfg: ModelConfig, params: Mapping[str, np.ndarray], dtype: str, device: str):
        model, hooks, to_numpy = self.build(cfg, params, dtype, device), self.hooks, self.to_numpy

        class Runner:
            def run(self, sublayer: str, inputs: Mapping[str, Any]) -> np.ndarray:
                if sublayer not in hooks:
                    raise NotSupported(f"no hook for {sublayer}")
                return np.asarray(to_numpy(hooks[sublayer](model, inputs)))

        return Runner()
