"""The golden's output computed once per case for every worker of a run
(conformance.executors.shared_references): one computes while the others wait, arrays and
tuples of arrays come back equal and memory-mapped, a lock left by a dead process is taken over,
and a reference that is not arrays is computed by each process that needs it."""

from __future__ import annotations

import os
import threading
import time

import numpy as np

from conformance.executors.shared_references import EMPTY_LOCK_SECONDS, SharedReferences, shared_reference


def test_one_computes_while_the_others_wait(tmp_path):
    shared, calls, results = SharedReferences(tmp_path), [], []
    start = threading.Barrier(4)

    def compute():
        calls.append(1)
        time.sleep(0.3)  # long enough for the others to find the lock
        return np.arange(12.0).reshape(3, 4)

    def worker():
        start.wait()
        results.append(shared.get("forward-long", compute))

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(calls) == 1 and len(results) == 4
    assert all(np.array_equal(result, np.arange(12.0).reshape(3, 4)) for result in results)
    assert all(isinstance(result, np.memmap) for result in results)  # each maps the stored file, its computer too
    assert not list(tmp_path.glob("*.lock"))


def test_tuples_come_back_as_tuples(tmp_path):
    tokens, logits = np.array([[5, 2, 0]]), np.linspace(0, 1, 30).reshape(1, 3, 10)
    SharedReferences(tmp_path).get("generate-none", lambda: (tokens, logits))
    stored = SharedReferences(tmp_path).get("generate-none", lambda: 1 / 0)
    assert isinstance(stored, tuple) and len(stored) == 2
    assert np.array_equal(stored[0], tokens) and stored[0].dtype == tokens.dtype and np.array_equal(stored[1], logits)


def test_a_lock_left_by_a_dead_process_is_taken_over(tmp_path):
    (tmp_path / "decode-far.lock").write_text("999999999")  # no such process
    assert SharedReferences(tmp_path).get("decode-far", lambda: np.ones(2)).sum() == 2
    empty = tmp_path / "forward-none.lock"
    empty.touch()  # made, its pid never written: stale once old enough
    old = time.time() - EMPTY_LOCK_SECONDS - 1
    os.utime(empty, (old, old))
    assert SharedReferences(tmp_path).get("forward-none", lambda: np.zeros(3)).shape == (3,)


def test_a_reference_that_is_not_arrays_is_computed_by_each_process(tmp_path):
    calls = []

    def compute():
        calls.append(1)
        return {"gradients": np.ones(2)}

    first = shared_reference(SharedReferences(tmp_path), "grad-mha-none", compute)
    second = shared_reference(SharedReferences(tmp_path), "grad-mha-none", compute)
    assert len(calls) == 2 and np.array_equal(first["gradients"], second["gradients"])
    assert shared_reference(None, "grad-mha-none", compute) is not None and len(calls) == 3


def test_a_producer_computes_every_reference_before_anyone_asks_and_lets_go_of_what_fails(tmp_path):
    """The harness computes the references for its workers (Producer): a reader waits for the
    file instead of computing, and a reference the producer could not compute is the reader's."""
    from conformance.executors.shared_references import Producer

    shared, computed, go = SharedReferences(tmp_path), [], threading.Event()

    def compute(name):
        go.wait(5)
        computed.append(name)
        if name == "forward-far":
            raise ValueError("no such case here")
        return np.full(3, float(len(name)))

    producer = Producer(shared, ["forward-none", "decode-far", "forward-none", "forward-far"], compute)
    assert sorted(path.name for path in tmp_path.glob("*.lock")) == [
        "decode-far.lock", "forward-far.lock", "forward-none.lock"]  # every case held before anyone asks
    go.set()

    def never():
        raise AssertionError("a reader computed a reference the producer holds")

    np.testing.assert_array_equal(shared.get("decode-far", never), np.full(3, 10.0))
    np.testing.assert_array_equal(shared.get("forward-none", never), np.full(3, 12.0))
    assert shared.get("forward-far", lambda: np.zeros(2)).shape == (2,)  # let go: the reader's own
    producer.close()
    assert computed == ["forward-none", "decode-far", "forward-far"]
    assert not list(tmp_path.glob("*.lock"))


def test_the_harness_computes_every_shareable_reference_for_its_workers(monkeypatch):
    """No worker casts the golden's float64 weights: every reference the workers read was computed
    once in the calling process (had a worker computed one, it would have held its lock first)."""
    from conformance import harness
    from conformance.harness import PASS, plan_matrix, run_matrix
    from spec import conformance_params, get_preset

    cfg = get_preset("llama-tiny")
    computed = []
    monkeypatch.setattr(harness, "references_here", lambda params, workers, total: True)  # as for a real checkpoint
    original = harness.reference_for
    monkeypatch.setattr(harness, "reference_for",
                        lambda cfg, params, case, golden, kept: computed.append(case.name) or original(
                            cfg, params, case, golden, kept))
    plan = plan_matrix(cfg, ["numpy-float32", "torch"], ["float32"], ["cpu"])
    results = run_matrix(cfg, conformance_params(cfg), plan, pattern="forward-", jobs=2)
    ran = {f"{r.sublayer}-{r.mask_case}" for r in results if r.status == PASS}
    assert ran and len(results) == 2 * len(ran)
    assert sorted(computed) == sorted(ran)  # each case once, here


def test_a_reference_stored_between_the_look_and_the_lock_is_read_not_computed_again(tmp_path, monkeypatch):
    """A process looks (nothing stored), and before it takes the lock the holder stores the
    reference and lets go: it must read that one, not compute and store a second (renaming onto
    the stored folder raised, and the worker process died with the column's cells; CI saw it)."""
    shared = SharedReferences(tmp_path)
    shared.get("forward-none", lambda: np.arange(3.0))  # the other process's
    looks = iter([None])
    original = SharedReferences._read
    monkeypatch.setattr(SharedReferences, "_read",
                        lambda self, name: next(looks, "again") and original(self, name))

    def never():
        raise AssertionError("computed a reference stored already")

    np.testing.assert_array_equal(shared.get("forward-none", never), np.arange(3.0))
    assert not list(tmp_path.glob("*.lock")) and not list(tmp_path.glob(".*.tmp"))


def test_a_second_store_of_one_reference_keeps_the_first(tmp_path):
    """A process that took over a lock it wrongly thought left by the dead stores what is there already."""
    shared = SharedReferences(tmp_path)
    shared.put("decode-far", np.ones(2))
    shared.put("decode-far", np.ones(2))
    np.testing.assert_array_equal(shared.get("decode-far", lambda: 1 / 0), np.ones(2))
    assert not list(tmp_path.glob(".*.tmp"))
