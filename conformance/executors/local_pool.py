"""The local executor: columns of the conformance matrix in parallel worker processes.

A column (backend, dtype, device) is independent of every other: it loads its own runner and
compares each case with the golden. Most of a JAX column's time is Python tracing and lowering
hundreds of small XLA programs, which one process does on one core; workers run several
columns at once. Results are put back in the order the sequential run gives them.

A worker is a fresh interpreter (`python -m conformance.executors.local_pool`) fed messages on its stdin
and answering on its stdout (length-prefixed JSON; the parameters in one weights file that every
worker memory-maps, so they share its pages; no pickle anywhere in this project): not a fork (JAX and torch hold threads a fork would copy half
of), and not multiprocessing's spawn, which re-imports the caller's main module. So a worker
sees only what a fresh import registers: a backend registered by a dotted path runs in a worker,
one registered with a callable at run time (conformance.byo) runs in the calling process. A
worker that dies turns the cells it had not finished into errors that quote its last words.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import queue
import struct
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from conformance.adapter import get_backend, importable_by_name, register_backend, registered_paths
from conformance.cases import TEXT_CASES, Case, build_case, is_backward
from conformance.cells import ERROR, CellResult, golden_runner_for, reference_for, run_cell
from conformance.executors import Column, OnResult, WorkItem, column_groups, cost_rank
from conformance.executors.shared_references import Producer, SharedReferences, shared_reference
from conformance.plan.memory import MemoryLedger, give_back_freed, resident_memory
from spec import ModelConfig
from spec.weights import load_weights, save_weights

_LENGTH = struct.Struct(">Q")


def _write(stream, payload: bytes) -> None:
    stream.write(_LENGTH.pack(len(payload)) + payload)
    stream.flush()


def _read(stream) -> bytes:
    """One message; EOFError when the other side has closed the pipe."""
    def exactly(size: int) -> bytes:
        data = stream.read(size)
        if len(data) != size:
            raise EOFError("the pipe closed mid-message")
        return data
    return exactly(_LENGTH.unpack(exactly(_LENGTH.size))[0])


def _send(stream, message) -> None:
    # NumPy scalars (an error's index, say) are written as the Python numbers they hold
    _write(stream, json.dumps(message, default=lambda value: value.item()).encode())


def _receive(stream):
    return json.loads(_read(stream))


def _result_message(result) -> dict:
    return dataclasses.asdict(result)  # floats, strings and a tuple of ints: JSON keeps them (NaN too)


def _case_message(case: Case) -> dict:
    """A case whose inputs are token ids, None and numbers (a generate or text case), as JSON: every
    field of the case (a hybrid's depth and amplification are its bound's, SPEC §8)."""
    inputs = {key: {"ids": value.tolist()} if isinstance(value, np.ndarray) else value
              for key, value in case.inputs.items()}
    return {**{field.name: getattr(case, field.name) for field in dataclasses.fields(Case)}, "inputs": inputs}


def _case_from(message: dict) -> Case:
    inputs = {key: np.asarray(value["ids"], dtype=np.int64) if isinstance(value, dict) else value
              for key, value in message["inputs"].items()}
    return Case(**{**message, "inputs": inputs})


def _result_from(message: dict) -> CellResult:
    worst = message.pop("worst_index")
    for key in ("tokens", "golden_tokens"):  # rows of ids: tuples, as the cell made them
        if message.get(key) is not None:
            message[key] = tuple(tuple(row) for row in message[key])
    return CellResult(**message, worst_index=None if worst is None else tuple(worst))


def _cell_error(column: tuple[str, str, str], case_name: str, reason: str) -> CellResult:
    name, dtype, device = column
    sublayer, mask_case = case_name.rsplit("-", 1)  # a mask case has no '-'; a backward sublayer has ('grad-mha')
    return CellResult(name, device, dtype, sublayer, mask_case, ERROR, reason=reason)


def auto_jobs(columns: Sequence[tuple[str, str, str]]) -> int:
    """Workers for a plan: one per core and column on the CPU; none where a column runs on a GPU
    (several processes would each hold a CUDA context, and JAX takes most of the GPU's memory
    in every process)."""
    if any(device != "cpu" for _, _, device in columns):
        return 1
    return max(1, min(os.cpu_count() or 1, sum(1 for name, _, _ in columns if importable_by_name(name))))


class _Worker:
    """One worker process, and a thread that turns its answers into messages on a queue."""

    def __init__(self, number: int, threads: int, inbox: queue.Queue, preload: Sequence[str] = ()):
        self.number, self.column, self.group = number, None, []
        self.baseline = self.kept = 0  # bytes resident once set up; what a finished column left beyond that
        self.stderr = tempfile.TemporaryFile()
        # torch sizes its thread pool at import: the cores are shared among the workers
        environment = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        argv = [sys.executable, "-m", "conformance.executors.local_pool"] + (["--preload", ",".join(preload)] if preload else [])
        self.process = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr,
                                        env=environment)
        threading.Thread(target=self._listen, args=(inbox,), daemon=True).start()

    def send(self, message) -> None:
        _send(self.process.stdin, message)

    def send_setup(self, setup: tuple) -> None:
        cfg_json, weights, references, cases, backends, threads, amplifications = setup
        _send(self.process.stdin, {"config": cfg_json, "weights": weights, "references": references, "cases": cases,
                                   "backends": backends, "threads": threads, "amplifications": amplifications})

    def _listen(self, inbox: queue.Queue) -> None:
        try:
            while True:
                kind, payload = _receive(self.process.stdout)
                if kind == "cell":
                    payload = (payload[0], _result_from(payload[1]))
                inbox.put((self, (kind, payload)))
        except (EOFError, OSError, ValueError):
            inbox.put((self, ("exited", None)))

    def last_words(self) -> str:
        self.process.wait()
        self.stderr.seek(0)
        lines = [line for line in self.stderr.read().decode(errors="replace").splitlines() if line.strip()]
        return f"exit code {self.process.returncode}" + (f": {lines[-1][:300]}" if lines else "")

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        self.stderr.close()


class WorkerPool:
    """Worker processes started before there is work for them, so that importing the frameworks
    (~2-3 s a process) overlaps whatever the caller does meanwhile (`rosetta check` plans the
    matrix, which imports them in its own process). `preload` names the backends a worker imports
    while it waits. Used by one run_in_workers, which closes it; close() is safe to repeat."""

    def __init__(self, count: int, preload: Sequence[str] = ()):
        self.inbox: queue.Queue = queue.Queue()
        self.threads = max(1, (os.cpu_count() or 1) // count)
        self.preload = tuple(preload)
        self.workers = [_Worker(number, self.threads, self.inbox, self.preload) for number in range(count)]

    def add(self) -> _Worker:
        self.workers.append(worker := _Worker(len(self.workers), self.threads, self.inbox, self.preload))
        return worker

    def keep(self, count: int) -> None:
        """Close the workers past the first `count`."""
        for worker in self.workers[count:]:
            worker.close()
        del self.workers[count:]

    def close(self) -> None:
        for worker in self.workers:
            worker.close()


RETIRE_SHARE = 0.1  # a worker whose process keeps this share of the memory limit beyond its next column's needs is replaced


def should_retire(kept: int, upcoming: int, limit: int) -> bool:
    """Whether a worker whose process still holds `kept` bytes more than when it was set up (its
    freed pages given back: the golden's float64 weights, XLA's compiled programs, an allocator's
    fragments) is replaced by a new process rather than given a column whose footprint is
    `upcoming` bytes: where what it keeps is more than that column would take by RETIRE_SHARE of
    the limit. The ledger counts the larger of the two for the worker, so keeping it is safe; a
    new process (its frameworks imported again, the golden cast again) only frees the rest."""
    return kept - upcoming >= RETIRE_SHARE * limit


class LocalPool:
    """The Executor of worker processes on this machine: up to `jobs` of them, a column group at
    a time each, taken from `pool` where one was started ahead (closed after the run either way)."""

    def __init__(self, jobs: int, pool: WorkerPool | None = None):
        self.jobs, self.pool = jobs, pool
        self.memory: MemoryLedger | None = None  # where set (the harness's), a column starts when its memory is free
        # where set (the harness's golden), the shareable references are computed here for the workers,
        # into `references` where set (a folder the harness's in-process columns read too)
        self.reference: Callable[[Case], object] | None = None
        self.references: str | None = None

    def run(self, cfg: ModelConfig, params: Mapping[str, np.ndarray], work: Sequence[WorkItem],
            on_result: OnResult) -> None:
        pool, self.pool = self.pool, None
        # a text case is made from prompts a worker does not have, and a generate case's rows were
        # chosen by the golden's greedy tokens (minutes at a real checkpoint's size): they go whole
        whole = {item.case.name: item.case for item in work
                 if item.case.mask_case in TEXT_CASES or item.case.sublayer == "generate"}
        cases = {item.case.name: item.case for item in work}
        produce = None if self.reference is None else (lambda name: self.reference(cases[name]))
        run_in_workers(cfg, params, [(item.index, item.case.name, item.column) for item in work], self.jobs,
                       on_result, pool, whole, self.memory, produce, self.references,
                       {name: case.amplification for name, case in cases.items()})

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()


def run_in_workers(cfg: ModelConfig, params: Mapping[str, np.ndarray], work: Sequence[tuple[int, str, tuple]],
                   jobs: int, on_result: Callable[[int, object], bool], pool: WorkerPool | None = None,
                   whole_cases: Mapping[str, Case] | None = None, memory: MemoryLedger | None = None,
                   produce: Callable[[str], object] | None = None, references: str | None = None,
                   amplifications: Mapping[str, float] | None = None) -> None:
    """Run work items (index, case name, column) in up to `jobs` worker processes, a column at a
    time each, from `pool` where one was started ahead (it is closed here either way). A worker
    builds each case from its name, but for `whole_cases`, which it is sent, taking the case's
    amplification from `amplifications` where it is there (found by this process's golden).
    on_result(index, result) is called in this process as each cell finishes; it returns True to
    stop the run. With `memory`, a worker starts a column only when its footprint fits beside the
    running ones' (conformance.plan.memory.MemoryLedger); else it waits for one to finish. A worker
    gives its freed pages back after each cell and says what it still holds after each column: the
    ledger counts that, and a worker that keeps RETIRE_SHARE of the limit is replaced (should_retire).
    With `produce` (case name -> the golden's reference), this process computes the references of
    the shareable cases (not the gradient and training ones) for the workers, in the order they run
    them (executors.shared_references.Producer), into `references` where given (a folder another
    process or thread reads too), else into a folder of the run's own."""
    by_column: dict[Column, list[tuple[int, str]]] = {}
    for index, case_name, column in work:
        by_column.setdefault(column, []).append((index, case_name))
    groups = column_groups(sorted(by_column, key=cost_rank))
    jobs = max(1, min(jobs, len(groups)))
    # the weights go to the workers as one file each maps: its pages are shared, not copied per worker
    folder = tempfile.TemporaryDirectory(prefix="rosetta-weights-")
    weights = os.path.join(folder.name, "weights.safetensors")
    save_weights(weights, cfg, params)
    # and each case's golden output is computed once for all of them: here (produce), or by the
    # first worker that needs it
    if references is None:
        references = os.path.join(folder.name, "references")
        os.mkdir(references)
    cases = {name: _case_message(case) for name, case in (whole_cases or {}).items()}
    setup = (cfg.to_json(), weights, references, cases, registered_paths(), max(1, (os.cpu_count() or 1) // jobs),
             dict(amplifications or {}))
    if pool is None:
        pool = WorkerPool(jobs)
    pool.keep(jobs)
    while len(pool.workers) < jobs:
        pool.add()
    inbox, workers = pool.inbox, list(pool.workers)
    unfinished = {index for index, _, _ in work}

    waiting: list[_Worker] = []  # workers whose next column does not fit in memory beside the running ones
    running = len(workers)

    def give_work(worker: _Worker) -> None:
        """The next column of the worker's group, else the first column of the first group that fits
        in memory now; a worker none fits for waits."""
        if memory is not None:
            memory.release(worker, worker.kept)
        if not worker.group and groups:
            fitting = next((i for i, group in enumerate(groups) if memory is None
                            or memory.try_take(worker, group[0])), None)
            if fitting is None:
                wait(worker)
                return
            worker.group = groups.pop(fitting)
        elif worker.group and memory is not None and not memory.try_take(worker, worker.group[0]):
            wait(worker)
            return
        worker.column = worker.group.pop(0) if worker.group else None
        worker.send(None if worker.column is None else [worker.column, by_column[worker.column]])

    def wait(worker: _Worker) -> None:
        """A worker whose next column does not fit waits holding nothing: one whose process keeps
        memory from its last column is replaced. What a waiting owner keeps no finishing column
        frees, so with every owner waiting none would ever start (a Qwen3-Next layer's check hung so)."""
        if worker.kept > 0:
            retire(worker)
        else:
            waiting.append(worker)

    def retire(worker: _Worker) -> None:
        """Stop the worker and give its unstarted columns, with a new process, to the next one."""
        nonlocal running
        if memory is not None:
            memory.release(worker)
        if worker.group:
            groups.insert(0, worker.group)
            worker.group = []
        worker.send(None)
        if groups:
            workers.append(replacement := pool.add())
            replacement.send_setup(setup)
            running += 1
            give_work(replacement)

    def wake_waiting() -> None:
        for worker in list(waiting):
            waiting.remove(worker)
            give_work(worker)

    producer = None
    try:
        if produce is not None:  # in the order the columns ask for them; the gradient and training cases' stay theirs
            ordered = [case_name for _, case_name, _ in sorted(work, key=lambda item: cost_rank(item[2]))]
            producer = Producer(SharedReferences(references),
                                [name for name in ordered if not is_backward(name.split("-")[0])], produce)
        for worker in list(workers):  # every process is started before any setup is sent: they import at once
            worker.send_setup(setup)
            give_work(worker)
        while running:
            try:  # a waiting worker may be let in by memory freed elsewhere (the in-process columns)
                worker, (kind, payload) = inbox.get(timeout=1.0 if waiting else None)
            except queue.Empty:
                wake_waiting()
                continue
            if worker not in workers:  # a worker of the pool closed unused says it exited: not ours
                continue
            if kind == "cell":
                index, result = payload
                unfinished.discard(index)
                if on_result(index, result):
                    return
            elif kind == "ready":
                worker.baseline = payload
            elif kind == "column done":
                worker.column, worker.kept = None, max(0, payload - worker.baseline)
                upcoming = worker.group[0] if worker.group else groups[0][0] if groups else None
                if memory is not None and upcoming is not None \
                        and should_retire(worker.kept, memory.footprint(upcoming), memory.limit):
                    # what a process keeps (XLA's compiled programs, an allocator's fragments) would sit
                    # beside its next column: a new process takes it, where the ledger's figures hold again
                    retire(worker)
                else:
                    give_work(worker)
                wake_waiting()
            elif kind == "exited":
                running -= 1
                if memory is not None:
                    memory.release(worker)
                    wake_waiting()
                if worker.column is not None:  # died inside a column: its unfinished cells are errors
                    words = worker.last_words()
                    for index, case_name in by_column[worker.column]:
                        if index in unfinished:
                            unfinished.discard(index)
                            if on_result(index, _cell_error(worker.column, case_name,
                                                            f"the worker process running this column died ({words})")):
                                return
                    if worker.group:  # its group's columns not started go first to the next worker
                        groups.insert(0, worker.group)
                        worker.group = []
                    if groups:  # the crash stays with its column: a new worker takes the rest
                        workers.append(replacement := pool.add())
                        replacement.send_setup(setup)
                        running += 1
                        give_work(replacement)
    finally:
        if producer is not None:
            producer.close()
        pool.close()
        folder.cleanup()


def _serve() -> None:
    """The worker's side: setup, then columns until told to stop (None)."""
    answers = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # a stray print must not break the message stream
    requests = sys.stdin.buffer

    if sys.argv[1:2] == ["--preload"]:
        for name in sys.argv[2].split(","):
            try:
                get_backend(name)  # imports its framework now; a failure is reported when a column asks
            except Exception:  # noqa: BLE001
                pass
    setup = _receive(requests)
    for name, path in setup["backends"].items():  # as registered in the calling process, at run time too
        register_backend(name, path)
    cfg, params = load_weights(setup["weights"], ModelConfig.from_json(setup["config"]), mapped=True)
    # built when a column first asks for it: a worker builds only the cases of its own columns
    # (the training cases' inputs take a golden backward pass to make)
    cases: dict = {name: _case_from(message) for name, message in setup["cases"].items()}
    amplifications: dict = setup["amplifications"]  # the harness's golden found them: not found again here
    golden, references, runners = golden_runner_for(cfg, params), {}, {}
    shared = SharedReferences(setup["references"])
    _send(answers, ["ready", resident_memory()])
    while (task := _receive(requests)) is not None:
        (name, dtype, device), items = task
        for index, case_name in items:
            try:
                if case_name not in cases:
                    cases[case_name] = build_case(cfg, params, *case_name.rsplit("-", 1),  # mask cases have no '-'
                                                  lambda: golden.p, amplification_found=amplifications.get(case_name))
                case = cases[case_name]
                if case_name not in references:
                    references[case_name] = shared_reference(shared, case_name,
                                                             lambda: reference_for(cfg, params, case, golden, {}))
            except Exception as error:  # noqa: BLE001 - the cell says why; the worker goes on with the column
                result = _cell_error((name, dtype, device), case_name, "its case or the golden's reference could not "
                                     f"be made: {type(error).__name__}: {error}")
            else:
                result = run_cell(cfg, params, case, name, dtype, device, references[case_name], runners)
            give_back_freed()  # what the cell freed, so the memory measured after the column is what it keeps
            _send(answers, ["cell", [index, _result_message(result)]])
        runners.clear()  # its weights' copies go now, not when the next column loads
        gc.collect()
        give_back_freed(above=0)  # as cells._drop: the figure sent next is what the process keeps
        _send(answers, ["column done", resident_memory()])


if __name__ == "__main__":
    _serve()
