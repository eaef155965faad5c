"""Columns scheduled by memory (issue 38, conformance.memory): a column starts only where its
footprint fits beside the running ones', else its worker waits; one that cannot fit at all is
skipped with its figure, never started to be killed by the kernel."""

from __future__ import annotations

import threading

import pytest

from conformance import harness
from conformance.cells import ABSENT, PASS, SKIP
from conformance.harness import plan_matrix, run_matrix
from conformance.memory import FOOTPRINTS, MemoryLedger, column_footprint
from spec import conformance_params, get_preset

CFG = get_preset("llama-tiny")
PARAMS = conformance_params(CFG)
GB = 10 ** 9


def test_a_column_waits_for_memory_and_one_alone_always_fits():
    ledger = MemoryLedger(10 * GB, lambda column: {"a": 6 * GB, "b": 6 * GB, "c": 3 * GB}[column])
    assert ledger.try_take("worker 1", "a")
    assert not ledger.try_take("worker 2", "b")  # 12 GB together: waits
    assert ledger.try_take("worker 2", "c")  # 9 GB: fits beside
    ledger.release("worker 1")
    assert ledger.try_take("worker 1", "b")
    ledger.release("worker 1"), ledger.release("worker 2")
    huge = MemoryLedger(1 * GB, lambda column: 5 * GB)
    assert huge.try_take("worker", "anything")  # alone it runs: why_not decides whether it may at all
    assert "needs about 5.0 GB" in huge.why_not(("torch", "float32", "cpu"))


def test_take_waits_until_another_owner_releases():
    ledger = MemoryLedger(10 * GB, lambda column: 6 * GB)
    ledger.try_take("worker", "a")
    taken = threading.Event()
    waiter = threading.Thread(target=lambda: (ledger.take("in-process", "b"), taken.set()))
    waiter.start()
    assert not taken.wait(0.3)
    ledger.release("worker")
    assert taken.wait(5)
    waiter.join()


def test_a_footprint_grows_with_the_dtype_the_backend_and_the_longest_case():
    qwen = get_preset("qwen2-tiny")
    column = ("torch", "float32", "cpu")
    assert column_footprint(qwen, ("torch", "float64", "cpu"), 6) > column_footprint(qwen, column, 6)
    assert column_footprint(qwen, ("onnx", "float32", "cpu"), 6) > column_footprint(qwen, column, 6)
    assert column_footprint(qwen, column, 1003) > column_footprint(qwen, column, 6)
    assert set(FOOTPRINTS) >= {"torch", "jax", "onnx", "transformers", "onnxruntime-genai", "numpy-float32"}


class _Counting(MemoryLedger):
    """A ledger that records the most owners holding memory at once."""

    most = 0

    def try_take(self, owner, column) -> bool:
        taken = super().try_take(owner, column)
        _Counting.most = max(_Counting.most, len(self.held))
        return taken


@pytest.mark.parametrize("limit_in_columns, most", [(1.5, 1), (2.5, 2)])
def test_columns_that_do_not_fit_together_run_one_after_another(monkeypatch, limit_in_columns, most):
    _Counting.most = 0
    monkeypatch.setattr(harness, "MemoryLedger", _Counting)
    monkeypatch.setattr(harness, "column_footprint", lambda cfg, column, longest: GB)
    monkeypatch.setattr(harness, "available_memory", lambda: int(limit_in_columns * GB / harness.COLUMNS_SHARE))
    plan = plan_matrix(CFG, ["numpy-float32", "torch"], ["float32", "float64"], ["cpu"])
    results = run_matrix(CFG, PARAMS, plan, pattern="forward-none", jobs=2)
    ran = [r for r in results if r.status != SKIP]  # numpy-float32 has no float64
    assert len(ran) == 3 and all(r.status == PASS for r in ran)
    assert _Counting.most == most


def test_a_column_that_cannot_fit_at_all_is_skipped_with_its_figure(monkeypatch):
    monkeypatch.setattr(harness, "column_footprint",
                        lambda cfg, column, longest: 50 * GB if column[0] == "torch" else GB)
    monkeypatch.setattr(harness, "available_memory", lambda: 20 * GB)
    plan = plan_matrix(CFG, ["numpy-float32", "torch"], ["float32"], ["cpu"])
    results = run_matrix(CFG, PARAMS, plan, pattern="forward-")
    torch_cells = [r for r in results if r.backend == "torch"]
    assert torch_cells and all(r.status == SKIP and r.skip == ABSENT for r in torch_cells)
    assert "needs about 50.0 GB" in torch_cells[0].reason and "17.0 GB" in torch_cells[0].reason
    assert all(r.status == PASS for r in results if r.backend == "numpy-float32")


def test_a_worker_that_ran_a_large_column_is_replaced_by_a_new_process(monkeypatch):
    """A process keeps most of what a large column took: the ledger's figures hold only for a new one."""
    from conformance.executors import local_pool

    added = []
    add = local_pool.WorkerPool.add
    monkeypatch.setattr(local_pool.WorkerPool, "add", lambda self: added.append(1) or add(self))
    monkeypatch.setattr(harness, "column_footprint", lambda cfg, column, longest: 5 * GB)
    monkeypatch.setattr(harness, "golden_footprint", lambda cfg, params, longest, available: 0)
    monkeypatch.setattr(harness, "available_memory", lambda: 20 * GB)  # 5 GB is over RETIRE_SHARE of 17 GB
    plan = plan_matrix(CFG, ["numpy-float32", "torch"], ["float32"], ["cpu"])
    results = run_matrix(CFG, PARAMS, plan, pattern="forward-none", jobs=1, executor=local_pool.LocalPool(1))
    assert [r.status for r in results] == [PASS, PASS]
    assert len(added) == 1  # the one worker replaced after its first column; none after the last


def test_a_columns_footprint_counts_the_longest_case_it_runs(monkeypatch):
    """-k forward-none on a rotary model: the 6 positions of that case, not decode-far's 1003."""
    seen = []
    monkeypatch.setattr(harness, "column_footprint", lambda cfg, column, longest: seen.append(longest) or GB)
    plan = plan_matrix(CFG, ["torch"], ["float32"], ["cpu"])
    assert [r.status for r in run_matrix(CFG, PARAMS, plan, pattern="forward-none")] == [PASS]
    assert set(seen) == {6}
    seen.clear()
    run_matrix(CFG, PARAMS, plan, pattern="decode-far")
    assert set(seen) == {min(1003, CFG.max_len)}
