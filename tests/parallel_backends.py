"""Backends for tests/test_parallel.py, importable by dotted path from a worker process."""

import os

import numpy as np

from conformance.backends.numpy_backend import NumpyFloat32Backend


class CrashingBackend(NumpyFloat32Backend):
    """The numpy float32 backend, whose process dies at the fourth cell of the column."""

    name = "crashing"

    def load(self, cfg, params, dtype, device):
        runner = super().load(cfg, params, dtype, device)

        class Crashing:
            calls = 0

            def run(self, sublayer, inputs):
                Crashing.calls += 1
                if Crashing.calls > 3:
                    os.write(2, b"simulated crash\n")
                    os._exit(3)
                return runner.run(sublayer, inputs)

        return Crashing()


class ZerosBackend(NumpyFloat32Backend):
    """Answers zeros everywhere: every cell fails."""

    name = "zeros"

    def load(self, cfg, params, dtype, device):
        runner = super().load(cfg, params, dtype, device)

        class Zeros:
            def run(self, sublayer, inputs):
                return np.zeros_like(runner.run(sublayer, inputs))

        return Zeros()
