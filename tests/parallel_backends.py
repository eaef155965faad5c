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


class SiblingBackend(NumpyFloat32Backend):
    """numpy float32 under another name, of the program family 'siblings'; it writes its name,
    dtype and process id to the file $ROSETTA_TEST_LOAD_NOTES when it loads."""

    name = "sibling"
    program_family = "siblings"

    def load(self, cfg, params, dtype, device):
        notes = os.environ.get("ROSETTA_TEST_LOAD_NOTES")
        if notes:
            with open(notes, "a") as file:
                file.write(f"{self.name} {dtype} {os.getpid()}\n")
        return super().load(cfg, params, dtype, device)


class OtherSiblingBackend(SiblingBackend):
    name = "other-sibling"


class CrashingSiblingBackend(CrashingBackend):
    """The crashing backend in the 'siblings' family: its worker dies inside the group."""

    name = "crashing-sibling"
    program_family = "siblings"
