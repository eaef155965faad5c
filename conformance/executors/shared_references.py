"""The golden's output for each case, computed once for all the worker processes of a run.

Every column compares with the same reference, and at a real checkpoint's size one whole-model
reference costs more than the cells that use it (Qwen2.5-0.5B's forward-long: ~1.5 TFLOP in
float64). The first worker that needs a case's reference takes its lock file and computes it;
the others wait for the file and memory-map it. A worker that dies holding a lock leaves it to
the next one that asks. Only array references are shared (a forward's output, a generate case's
tokens and step logits); a gradient or training case's reference, an object holding a runner, is
computed by each worker that needs it, as before. Where the calling process holds the golden
already (the local executor's harness: it built the generate cases with it), a Producer there
computes every shareable reference, in the order the workers will ask, so that no worker casts
the golden's float64 weights (1 GB at SmolLM2-135M's size, 4 GB at Qwen2.5-0.5B's).
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

POLL_SECONDS = 0.05
EMPTY_LOCK_SECONDS = 10.0  # a lock still without its holder's pid after this was left by a dead process


class SharedReferences:
    """References of one run in `folder`, shared by the processes given that folder."""

    def __init__(self, folder: str | os.PathLike):
        self.folder = Path(folder)

    def get(self, case_name: str, compute: Callable[[], object]) -> object:
        """The case's reference: from the folder, else computed here (and stored, for arrays), else
        waited for while another process computes it."""
        while True:
            if (stored := self._read(case_name)) is not None:
                return stored
            if not self.hold(case_name):
                lock = self.folder / f"{case_name}.lock"
                if not _alive(lock):  # its holder died: the next one to ask computes it
                    lock.unlink(missing_ok=True)
                time.sleep(POLL_SECONDS)
                continue
            try:
                # another process may have stored it and let go between the look above and the lock
                if (stored := self._read(case_name)) is not None:
                    return stored
                reference = compute()
                self.put(case_name, reference)
            finally:
                self.let_go(case_name)
            stored = self._read_stored(case_name)  # mapped, so this process does not hold it in memory
            return reference if stored is None else stored

    def hold(self, case_name: str) -> bool:
        """Take the case's lock for this process, which will put its reference; False where another has it."""
        try:
            descriptor = os.open(self.folder / f"{case_name}.lock", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return False
        os.write(descriptor, str(os.getpid()).encode())
        os.close(descriptor)
        return True

    def put(self, case_name: str, reference: object) -> None:
        """Store a reference whose lock this process holds: arrays whole or absent to a reader; anything
        else marked for each process to compute its own."""
        arrays = reference if isinstance(reference, tuple) else (reference,)
        if not all(isinstance(array, np.ndarray) for array in arrays):
            (self.folder / f"{case_name}.local").touch()  # each process computes its own
            return
        part = self.folder / f".{case_name}.{os.getpid()}.tmp"
        part.mkdir()
        for i, array in enumerate(arrays):
            np.save(part / f"{i}.npy", array)
        (part / ("tuple" if isinstance(reference, tuple) else "array")).touch()
        try:
            os.rename(part, self.folder / case_name)  # whole or absent, to a reader
        except OSError:  # stored already, by a process that took over a lock it thought left by the dead
            if not (self.folder / case_name).is_dir():
                raise
            shutil.rmtree(part)

    def let_go(self, case_name: str) -> None:
        (self.folder / f"{case_name}.lock").unlink(missing_ok=True)

    def _read(self, case_name: str) -> object | None:
        if (self.folder / f"{case_name}.local").exists():
            raise _ComputeHere
        return self._read_stored(case_name)

    def _read_stored(self, case_name: str) -> object | None:
        stored = self.folder / case_name
        if not stored.is_dir():
            return None
        arrays = tuple(np.lib.format.open_memmap(path, mode="r")  # .npy headers only: never a pickle
                       for path in sorted(stored.glob("*.npy"), key=lambda path: int(path.stem)))
        return arrays if (stored / "tuple").exists() else arrays[0]


class Producer:
    """References computed in one process for the others, in the order they will be asked for:
    every case is held (its lock taken) before any worker asks, so a worker waits for the file
    rather than casting the golden's float64 weights itself. A case whose reference cannot be
    computed here is let go: the first worker that needs it computes it (and reports its error)."""

    def __init__(self, references: SharedReferences, case_names, compute: Callable[[str], object]):
        self.references, self.compute = references, compute
        self.held = [name for name in dict.fromkeys(case_names) if references.hold(name)]
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name="golden references", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        for name in list(self.held):
            if self.stopped.is_set():
                break
            try:
                self.references.put(name, self.compute(name))
            except Exception:  # noqa: BLE001 - a worker computing it meets the error itself and reports it
                pass
            finally:
                self.references.let_go(name)
                self.held.remove(name)

    def close(self) -> None:
        """Stop after the reference being computed, and let go of the rest."""
        self.stopped.set()
        self.thread.join()
        for name in self.held:
            self.references.let_go(name)
        self.held = []


class _ComputeHere(Exception):
    """A reference another process found unshareable: this one computes its own."""


def shared_reference(references: SharedReferences | None, case_name: str, compute: Callable[[], object]) -> object:
    """The case's reference through `references` where a run shares them, else computed here."""
    if references is None:
        return compute()
    try:
        return references.get(case_name, compute)
    except _ComputeHere:
        return compute()


def _alive(lock: Path) -> bool:
    """Whether the process whose pid the lock holds still runs (a lock being written counts as alive)."""
    try:
        text = lock.read_text()
    except FileNotFoundError:
        return True  # gone already: the caller looks again
    if not text:  # its holder may have died between making it and writing its pid
        try:
            return time.time() - lock.stat().st_mtime < EMPTY_LOCK_SECONDS
        except FileNotFoundError:
            return True  # let go meanwhile: the caller looks again
    try:
        os.kill(int(text), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, ValueError):
        return True
    return True
