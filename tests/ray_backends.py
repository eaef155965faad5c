"""Backends for tests/test_ray.py, importable by dotted path from a Ray actor."""

import numpy as np

from conformance.backends.numpy_backend import NumpyFloat32Backend


class GpuLabelBackend(NumpyFloat32Backend):
    """numpy float32 that counts as running on 'cuda' wherever Ray gave its process a GPU: on a
    fake GPU node it shows where a CUDA column is placed, without a GPU."""

    name = "gpu-label"

    def devices(self) -> list[str]:
        import ray

        return ["cpu"] + (["cuda"] if ray.is_initialized() and ray.get_gpu_ids() else [])

    def supports(self, dtype: str, device: str) -> str | None:
        return None if dtype == "float32" else "float32 only"


class WritesItsInputsBackend(NumpyFloat32Backend):
    """numpy float32 that writes into the weights and inputs it is given (and undoes it), as a
    runner that transforms its arguments in place would: read-only arrays make it fail."""

    name = "writes-its-inputs"

    def load(self, cfg, params, dtype, device):
        for value in params.values():
            value += 0.0
        runner = super().load(cfg, params, dtype, device)

        class Writing:
            def run(self, sublayer, inputs):
                for value in inputs.values():
                    if isinstance(value, np.ndarray) and value.dtype.kind == "f":
                        value *= 1.0
                return runner.run(sublayer, inputs)

        return Writing()
