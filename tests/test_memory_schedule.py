"""Columns scheduled by memory (issue 38, conformance.plan.memory): a column starts only where its
footprint fits beside the running ones', else its worker waits; one that cannot fit at all is
skipped with its figure, never started to be killed by the kernel."""

from __future__ import annotations

import copy
import threading

import pytest

from conformance import harness
from conformance.cells import PASS, SKIP, TOO_LARGE
from conformance.harness import plan_matrix, run_matrix
from conformance.backends.numpy_backend import golden_output
from conformance.cases import build_case
from conformance.plan.cost import logit_rows
from conformance.plan.memory import (FOOTPRINTS, WORKER_BYTES, Extent, MemoryLedger, column_footprint, export_bytes,
                                     reference_bytes)
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
    # timeouts, not speeds: a take that did not wait would be done within a thread's start and one
    # try_take (microseconds), well inside 0.3 s; after the release, take is notified at once and
    # tries again within its own 1 s wait even unnotified, so 5 s is reached only by a hang
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


def test_a_mixture_computed_with_every_expert_on_every_token_is_counted_so(monkeypatch):
    """The sdpa paths (and their exports) run every expert on every token and stack the outputs: their
    columns are counted [tokens, E, d] twice over; the loops of the math paths, and a model without
    experts, are not."""
    import dataclasses

    from conformance.cases import BATCH
    from conformance.plan import memory

    mixture = get_preset("qwen3-next-tiny")
    stacked = 2 * BATCH * 1003 * mixture.moe.n_experts * mixture.d_model
    for name in ("torch", "jax", "onnx", "onnx-jax"):
        assert memory.every_expert_bytes(mixture, name, 1003) == stacked
        assert memory.every_expert_bytes(mixture.replace(moe=None), name, 1003) == 0
        counted = column_footprint(mixture, (name, "float64", "cpu"), 1003)
        monkeypatch.setitem(FOOTPRINTS, name, dataclasses.replace(FOOTPRINTS[name], every_expert_on_every_token=False))
        assert counted - column_footprint(mixture, (name, "float64", "cpu"), 1003) == 8 * stacked
    for name in ("torch-math", "jax-math", "numpy-float32", "transformers"):
        assert memory.every_expert_bytes(mixture, name, 1003) == 0


def test_an_onnx_column_that_exports_first_is_counted_at_the_exports_peak(monkeypatch):
    """An ONNX column whose export is not cached holds the exporter's copies of the weights before
    its sessions' (measured: 6.2 against 1.2 at float32 on SmolLM2-135M's shape): the ledger counts
    that column at the export's peak, and the same column at its sessions' once the export is made."""
    from conformance.backends.onnx_backend import OnnxBackend
    from conformance.cases import case_names

    cfg = get_preset("llama-tiny")
    params = conformance_params(cfg, seed=0)
    column = ("onnx", "float32", "cpu")
    plan = plan_matrix(cfg, ["onnx"], ["float32"], ["cpu"])
    assert export_bytes(cfg, column) > column_footprint(cfg, column, 6) / 3
    monkeypatch.setattr(OnnxBackend, "load_is_cached", lambda self, cfg, params, dtype: False)
    cold = harness.memory_ledger(cfg, params, plan, case_names(cfg), "forward-none", None).footprint(column)
    monkeypatch.setattr(OnnxBackend, "load_is_cached", lambda self, cfg, params, dtype: True)
    warm = harness.memory_ledger(cfg, params, plan, case_names(cfg), "forward-none", None).footprint(column)
    assert cold - warm == export_bytes(cfg, column) > 0
    assert export_bytes(cfg, ("torch", "float32", "cpu")) == 0


def _available(monkeypatch, size: int) -> None:
    """The machine's available memory, as the harness and conformance.plan.memory.columns_limit read it."""
    from conformance.plan import memory

    monkeypatch.setattr(harness, "available_memory", lambda: size)
    monkeypatch.setattr(memory, "available_memory", lambda: size)


class _Counting(MemoryLedger):
    """A ledger that records the most columns running at once (an owner holding a whole footprint:
    a worker between columns holds only what its process kept)."""

    most = 0

    def try_take(self, owner, column) -> bool:
        taken = super().try_take(owner, column)
        _Counting.most = max(_Counting.most, sum(1 for held in self.held.values() if held >= GB))
        return taken


@pytest.mark.parametrize("limit_in_columns, most", [(1.5, 1), (2.5, 2)])
def test_columns_that_do_not_fit_together_run_one_after_another(monkeypatch, limit_in_columns, most):
    _Counting.most = 0
    monkeypatch.setattr(harness, "MemoryLedger", _Counting)
    monkeypatch.setattr(harness, "column_footprint", lambda cfg, column, longest: GB)
    _available(monkeypatch, int(limit_in_columns * GB / harness.COLUMNS_SHARE))
    plan = plan_matrix(CFG, ["numpy-float32", "torch"], ["float32", "float64"], ["cpu"])
    results = run_matrix(CFG, PARAMS, plan, pattern="forward-none", jobs=2)
    ran = [r for r in results if r.status != SKIP]  # numpy-float32 has no float64
    assert len(ran) == 3 and all(r.status == PASS for r in ran)
    assert _Counting.most == most


def test_a_column_that_cannot_fit_at_all_is_skipped_with_its_figure(monkeypatch):
    monkeypatch.setattr(harness, "column_footprint",
                        lambda cfg, column, longest: 50 * GB if column[0] == "torch" else GB)
    _available(monkeypatch, 20 * GB)
    plan = plan_matrix(CFG, ["numpy-float32", "torch"], ["float32"], ["cpu"])
    results = run_matrix(CFG, PARAMS, plan, pattern="forward-")
    torch_cells = [r for r in results if r.backend == "torch"]
    assert torch_cells and all(r.status == SKIP and r.skip == TOO_LARGE for r in torch_cells)
    limit = f"{20 * harness.COLUMNS_SHARE:.1f} GB"  # the columns' share of the 20 GB available
    assert "needs about 50.0 GB" in torch_cells[0].reason and limit in torch_cells[0].reason
    assert all(r.status == PASS for r in results if r.backend == "numpy-float32")
    # a cause of its own among the grouped skip lines, not "not available here"
    from conformance.output.report import format_skips

    memory_line, = [line for line in format_skips(results) if "torch/float32/cpu" in line]
    assert memory_line.startswith(f"skipped {len(torch_cells)} cells, more than the memory holds, in 1 column")


def test_freed_pages_are_given_back_to_the_kernel():
    """What a cell freed on the heap stays resident until the allocator is told to trim it (glibc)."""
    import numpy as np

    from conformance.plan.memory import _MALLOC_TRIM, give_back_freed, resident_memory

    if _MALLOC_TRIM is None:
        pytest.skip("this C library has no malloc_trim (not glibc): nothing to give back by hand")
    give_back_freed(above=0)  # as after a trim: what follows is measured from there
    before = resident_memory()
    blocks = [np.ones(8192) for _ in range(2000)]  # 64 KiB each: below the mmap threshold, on the heap
    above = np.ones(8192)  # so the heap's top is not free and a plain free() trims nothing
    grown = resident_memory() - before
    # what moves the figures but the blocks' pages, 0.2 of grown (about 26 MB) leaving it hundreds of
    # times over: the allocator's granularity (a page per free region, above's 64 KiB) and the
    # interpreter's own allocations meanwhile (the list's 16 KB). Measured: all of grown kept, then
    # less than before given back (the trim returns other free pages too)
    del blocks
    assert resident_memory() - before > 0.8 * grown  # free() gave back nothing
    give_back_freed()
    assert resident_memory() - before < 0.2 * grown  # malloc_trim gave the blocks' pages back
    del above


def test_a_trim_waits_until_the_process_grew_and_its_heap_holds_enough_free(monkeypatch):
    """A trim gives back pages the next cell faults in again: until the process has grown by
    TRIM_ABOVE since the last trim, with as much free on its heap, none is made (the tiny presets'
    cells), then one is (a real-size cell's hundreds of MB). A heap that holds much free in fragments
    after a trim (a test worker after a catalogue) is not trimmed again for it, nor a process that grew
    by what it keeps (a column's weights loaded)."""
    import conformance.plan.memory as memory

    megabyte = 2**20
    trims, now = [], {}
    monkeypatch.setattr(memory, "_MALLOC_TRIM", lambda pad: trims.append((now["resident"], now["free"])))
    monkeypatch.setattr(memory, "heap_free_bytes", lambda: now["free"] * megabyte)
    monkeypatch.setattr(memory, "resident_memory", lambda: now["resident"] * megabyte)
    monkeypatch.setattr(memory, "_resident_since_trim", 0)
    for resident, free in ((100, 10), (150, 60), (900, 500), (900, 500), (950, 520), (800, 400), (860, 450),
                           (860, 470), (1200, 20), (1200, 470), (1300, 30), (1300, 100)):
        now.update(resident=resident, free=free)
        memory.give_back_freed(above=64 * megabyte)
    # 900: grown by 900 with 500 free; then 50 grown since it; 800 a low point, from which 860 is less
    # than 64 grown, whatever the free heap; 1200 grown by what it keeps (20 free), then trimmed once 470
    # are free; from there 100 grown with only 30 free, then with 100 free
    assert trims == [(900, 500), (1200, 470), (1300, 100)]


def test_what_a_process_keeps_after_its_column_is_held_until_its_next_one():
    ledger = MemoryLedger(10 * GB, lambda column: {"small": 2 * GB, "large": 6 * GB}[column])
    ledger.try_take("worker 1", "large")
    ledger.release("worker 1", kept=5 * GB)  # its process still holds 5 GB
    assert not ledger.try_take("worker 2", "large")  # 5 + 6 > 10
    assert ledger.try_take("worker 2", "small")
    assert ledger.try_take("worker 1", "small")  # 2 + max(2, 5) fits: the worker's own 5 GB counted once
    assert ledger.held == {"worker 1": 5 * GB, "worker 2": 2 * GB}
    ledger.release("worker 2")
    assert not ledger.try_take("worker 2", "large")  # 5 + 6 > 10 still
    ledger.release("worker 1")  # its process ended
    assert ledger.try_take("worker 2", "large")


class _FitsOneColumn(MemoryLedger):
    """A ledger whose limit holds two columns of a GB, but not one beside what two workers keep after theirs."""

    limit = property(lambda self: int(2.1 * GB), lambda self, value: None)


def test_owners_that_all_wait_for_memory_do_not_wait_for_ever(monkeypatch):
    """Two columns fit at once; each worker's process keeps a little more than a column after each of
    its own, and a column of this process's runs beside them. An owner waiting for memory holds nothing (a worker that
    keeps some is replaced, this process drops its runner first): where each waited holding what it
    kept, none could start again (the default check of a Qwen3-Next layer hung so, every process idle)."""
    from conformance.adapter import get_backend, register_backend, unregister_backend
    from conformance.executors import local_pool

    receive = local_pool._receive

    def kept_after_every_column(stream):  # each worker says it keeps 1.1 GB after each of its columns
        kind, payload = receive(stream)
        return [kind, {"ready": 0, "column done": int(1.1 * GB)}.get(kind, payload)]

    monkeypatch.setattr(local_pool, "_receive", kept_after_every_column)
    monkeypatch.setattr(harness, "MemoryLedger", _FitsOneColumn)
    monkeypatch.setattr(harness, "column_footprint", lambda cfg, column, longest: GB)
    here = copy.copy(get_backend("numpy-float32")[0])
    here.name = "here"
    register_backend("here", lambda: here)  # a callable: a backend of this process only
    try:
        plan = plan_matrix(CFG, ["numpy-float32", "torch", "torch-math", "here"], ["float32", "float64"], ["cpu"])
        results = []
        run = threading.Thread(target=lambda: results.extend(run_matrix(CFG, PARAMS, plan, pattern="forward-none",
                                                                        jobs=2)), daemon=True)
        run.start()
        run.join(timeout=300)
    finally:
        unregister_backend("here")
    assert not run.is_alive(), "the run waited for memory that no column would free"
    ran = [r for r in results if r.status != SKIP]  # numpy-float32 has no float64
    assert len(ran) == 6 and all(r.status == PASS for r in ran), [(r.test_id, r.status, r.reason) for r in ran]


def test_a_worker_is_replaced_only_where_it_keeps_more_than_its_next_column_takes():
    from conformance.executors.local_pool import RETIRE_SHARE, should_retire

    limit = 20 * GB
    assert not should_retire(4 * GB, 4 * GB, limit)  # the golden's weights, which the next column needs too
    assert not should_retire(5 * GB, 4 * GB, limit)  # 1 GB more than it needs: under RETIRE_SHARE
    assert should_retire(int(4 * GB + RETIRE_SHARE * limit), 4 * GB, limit)
    assert not should_retire(0, 1 * GB, limit)


def test_a_worker_that_keeps_a_large_column_is_replaced_by_a_new_process(monkeypatch):
    """What a process keeps after a column would sit beside the next: a new process takes it."""
    from conformance.executors import local_pool

    added, kept = [], []
    add = local_pool.WorkerPool.add
    monkeypatch.setattr(local_pool.WorkerPool, "add", lambda self: added.append(1) or add(self))
    monkeypatch.setattr(local_pool, "should_retire", lambda held, upcoming, limit: kept.append(held) or True)
    _available(monkeypatch, 20 * GB)
    plan = plan_matrix(CFG, ["numpy-float32", "torch"], ["float32"], ["cpu"])
    results = run_matrix(CFG, PARAMS, plan, pattern="forward-none", jobs=1, executor=local_pool.LocalPool(1))
    assert [r.status for r in results] == [PASS, PASS]
    assert len(added) == 1  # the one worker replaced after its first column; none after the last
    assert len(kept) == 1 and kept[0] >= 0  # asked with what the worker measured it kept


def test_a_columns_footprint_counts_the_longest_case_it_runs(monkeypatch):
    """-k forward-none on a rotary model: the 6 positions of that case, not decode-far's 1003; and
    decode-far's 1003 positions hold two rows of logits, its steps after the prefix (its reference's
    [3, 2, vocabulary]), not 1003: the memory once counted SmolLM2-135M's float32 columns 1.2 GB of
    logits that no column holds."""
    seen = []
    monkeypatch.setattr(harness, "column_footprint", lambda cfg, column, longest: seen.append(longest) or GB)
    plan = plan_matrix(CFG, ["torch"], ["float32"], ["cpu"])
    assert [r.status for r in run_matrix(CFG, PARAMS, plan, pattern="forward-none")] == [PASS]
    assert set(seen) == {Extent(6, 6)}
    seen.clear()
    far, = run_matrix(CFG, PARAMS, plan, pattern="decode-far")
    assert set(seen) == {Extent(min(1003, CFG.max_len), 2)}
    reference = build_case(CFG, PARAMS, "decode", "far")
    assert golden_output(CFG, PARAMS, "decode", reference.inputs).shape[1] == 2 == \
        logit_rows(CFG, "decode", "far") and reference_bytes(CFG, seen.pop()) == 3 * 2 * CFG.tgt_vocab_size * 8


def test_a_generate_case_goes_to_the_workers_whole(monkeypatch):
    """Its rows were chosen by the golden's greedy tokens: a worker (a replaced one too) must not
    decode them again, which at a real checkpoint's size costs minutes."""
    from conformance.executors import local_pool

    sent = {}
    monkeypatch.setattr(local_pool, "run_in_workers",
                        lambda cfg, params, work, jobs, on_result, pool, whole, *rest: sent.update(whole))
    plan = plan_matrix(CFG, ["torch"], ["float32"], ["cpu"])
    run_matrix(CFG, PARAMS, plan, pattern="*-none-*", jobs=2)  # forward-none and the other -none cases too
    assert set(sent) == {"generate-none"}
    message = local_pool._case_message(sent["generate-none"])
    again = local_pool._case_from(message)
    assert again == sent["generate-none"]  # every field but the inputs (compared next)
    assert all((again.inputs[key] == value).all() if hasattr(value, "shape") else again.inputs[key] == value
               for key, value in sent["generate-none"].inputs.items())


@pytest.mark.parametrize("text, size", [("6G", 6 * GB), ("6 GB", 6 * GB), ("512M", 512 * 10 ** 6), ("1.5g", 1.5 * GB),
                                        ("2000000000", 2 * GB)])
def test_a_memory_size_is_read_in_decimal_units(text, size):
    from conformance.plan.memory import parse_memory

    assert parse_memory(text) == size


@pytest.mark.parametrize("text", ["six", "-1G", "0", "G", "6Q"])
def test_a_memory_size_that_is_not_one_is_refused_naming_it(text):
    from conformance.plan.memory import parse_memory

    with pytest.raises(ValueError, match=f"--memory {text!r}"):
        parse_memory(text)


def test_a_memory_total_schedules_the_columns_within_what_is_left_of_it(monkeypatch):
    """--memory: the columns get the total less this process and its workers' frameworks."""
    from conformance.plan import memory

    _Counting.most = 0
    monkeypatch.setattr(harness, "MemoryLedger", _Counting)
    monkeypatch.setattr(harness, "column_footprint", lambda cfg, column, longest: GB)
    monkeypatch.setattr(harness, "golden_footprint", lambda cfg, params, longest, available: 0)
    monkeypatch.setattr(harness, "reference_bytes", lambda cfg, longest: 0)
    monkeypatch.setattr(memory, "available_memory", lambda: 100 * GB)
    monkeypatch.setattr(memory, "resident_memory", lambda: GB)
    plan = plan_matrix(CFG, ["numpy-float32", "torch"], ["float32", "float64"], ["cpu"])
    total = GB + 2 * memory.WORKER_BYTES + int(1.5 * GB)  # 1.5 GB for the columns: one at a time
    results = run_matrix(CFG, PARAMS, plan, pattern="forward-none", jobs=2, memory_total=total)
    assert [r.status for r in results if r.status != SKIP] == [PASS] * 3
    assert _Counting.most == 1
    with pytest.raises(memory.MemoryTooSmall, match=r"--memory 1.5 GB leaves nothing for the columns: this process "
                                                   r"holds 1.0 GB .* its 2 worker process\(es\) about 0.8 GB"):
        run_matrix(CFG, PARAMS, plan, pattern="forward-none", jobs=2, memory_total=int(1.5 * GB))


def test_rosetta_check_refuses_a_memory_that_holds_nothing_but_itself(capsys):
    from rosetta.main import main

    assert main(["check", "--preset", "llama-tiny", "--backends", "torch", "--memory", "10M", "--quiet"]) == 2
    assert "--memory 0.0 GB leaves nothing for the columns" in capsys.readouterr().err
    assert main(["check", "--preset", "llama-tiny", "--memory", "lots"]) == 2
    assert "--memory 'lots': give a size such as 6G" in capsys.readouterr().err


def test_the_harness_computes_the_references_where_the_workers_goldens_would_crowd_the_memory(monkeypatch):
    """Two workers' float64 goldens over a quarter of the memory: one golden, here, serves them."""
    import numpy as np

    from conformance.plan import memory

    monkeypatch.setattr(memory, "available_memory", lambda: 24 * GB)
    # arrays of a checkpoint's sizes without their memory: SmolLM2-135M's and Qwen2.5-0.5B's
    small, large = {"w": np.broadcast_to(np.float32(0), (135_000_000,))}, {"w": np.broadcast_to(np.float32(0), (494_000_000,))}
    assert not memory.references_here(small, 2)  # 2.2 GB of goldens beside 24: each worker its own
    assert memory.references_here(large, 2)  # 7.9 GB: the harness's
    assert memory.references_here(small, 2, total=6 * GB)  # --memory 6G: 2.2 GB is over a quarter
    assert not memory.references_here(large, 0)  # no workers


def test_a_budget_spends_nothing_on_a_column_the_memory_cannot_hold(monkeypatch):
    from conformance.check import _fit

    monkeypatch.setattr(harness, "column_footprint",
                        lambda cfg, column, longest: 50 * GB if column[0] == "torch" else GB)
    _available(monkeypatch, 20 * GB)
    plan = plan_matrix(CFG, ["numpy-float32", "torch"], ["float32"], ["cpu"])
    _, budgeted = _fit(CFG, PARAMS, plan, {"preset": "llama-tiny"}, 3600.0, False, None, None, 2)
    assert budgeted.chosen and {column[0] for _, _, column in budgeted.chosen} == {"numpy-float32"}


@pytest.mark.parametrize("sublayer, mask_case", [("forward", "none"), ("forward", "long"), ("loss", "none"),
                                                 ("decode", "incremental"), ("decode", "far"), ("decode", "pad_left")])
def test_the_rows_of_logits_counted_are_the_golden_references(sublayer, mask_case):
    """What the memory counts of a case's logits (conformance.plan.cost.logit_rows) against the rows
    of the golden's output (a loss is a number, computed from every position's logits)."""
    case = build_case(CFG, PARAMS, sublayer, mask_case)
    rows = logit_rows(CFG, sublayer, mask_case)
    if sublayer == "loss":
        assert rows == case.inputs["tgt_ids"].shape[1]
    else:
        output = golden_output(CFG, PARAMS, sublayer, case.inputs)
        assert output.shape[1] == rows
        # and they are all it keeps alive: a decode's steps sliced from the whole forward's logits
        # as a view kept the prompt's rows with them (decode-far at SmolLM2-135M's size: 1.2 GB for 2 rows)
        assert output.base is None or output.base.nbytes == output.nbytes


def _memory_of(monkeypatch, column_bytes: int, golden_bytes: int = 0) -> None:
    """A machine of 100 GB on which this process holds 1 GB, each column takes column_bytes and the
    golden golden_bytes (its weights; its references nothing)."""
    from conformance.plan import memory

    monkeypatch.setattr(harness, "column_footprint", lambda cfg, column, longest: column_bytes)
    monkeypatch.setattr(harness, "golden_footprint", lambda cfg, params, longest, available: golden_bytes)
    monkeypatch.setattr(harness, "reference_bytes", lambda cfg, longest: 0)
    _available(monkeypatch, 100 * GB)
    monkeypatch.setattr(memory, "resident_memory", lambda: GB)


@pytest.mark.parametrize("columns_at_once, jobs", [(1.5, 1), (2.5, 2)])
def test_a_memory_that_holds_one_column_at_a_time_runs_them_in_this_process(monkeypatch, columns_at_once, jobs):
    """--memory without --jobs: no more workers than the columns it holds at once, and none where
    that is one (a second would hold its frameworks while it waits)."""
    from conformance import check
    from conformance.plan import memory

    _memory_of(monkeypatch, GB)
    asked = []
    monkeypatch.setattr(check, "run_matrix", lambda *args, **kwargs: asked.append(kwargs["jobs"]) or [])
    total = GB + 2 * memory.WORKER_BYTES + int(columns_at_once * GB)
    check.check_model(preset="llama-tiny", backends=["numpy-float32", "torch"], dtypes=["float32"], memory=total)
    check.check_model(preset="llama-tiny", backends=["numpy-float32", "torch"], dtypes=["float32"], memory=total, jobs=2)
    assert asked == [jobs, 2]  # a --jobs given is kept
    # a total that holds this process but not two workers' frameworks: this process runs the columns
    check.check_model(preset="llama-tiny", backends=["numpy-float32", "torch"], dtypes=["float32"],
                      memory=GB + memory.WORKER_BYTES + int(0.3 * GB))
    assert asked[-1] == 1


def test_without_workers_the_golden_is_counted_once_beside_the_columns(monkeypatch):
    """A worker that computes its own references casts a golden of its own: its column's footprint
    counts it; the columns of this process run beside this process's golden, which the limit has
    already taken (else a column fitting beside it was refused: SmolLM2-135M's jax and onnx at
    --memory 6G)."""
    from conformance.cases import case_names

    _memory_of(monkeypatch, GB, golden_bytes=3 * GB)
    plan = plan_matrix(CFG, ["torch"], ["float32"], ["cpu"])
    names, column = case_names(CFG, False), ("torch", "float32", "cpu")
    in_workers = harness.memory_ledger(CFG, PARAMS, plan, names, None, None, workers=2, memory_total=10 * GB)
    here = harness.memory_ledger(CFG, PARAMS, plan, names, None, None, workers=0, memory_total=10 * GB)
    assert in_workers.footprint(column) == 4 * GB and here.footprint(column) == GB
    assert here.limit == 10 * GB - GB - 3 * GB  # this process, its golden's weights
    assert in_workers.limit == 10 * GB - GB - 3 * GB - 2 * WORKER_BYTES


def test_a_backend_may_take_more_activations_at_half_precision():
    """ONNX's float16 graphs hold more than its float32 ones (their casts' copies): measured apart."""
    from conformance.plan.memory import activation_bytes, activation_copies

    assert activation_copies("onnx", "float16") > activation_copies("onnx", "float32")
    assert activation_copies("torch", "float16") == activation_copies("torch", "float32")
    assert activation_bytes(CFG, ("onnx", "float16", "cpu"), 64) > activation_bytes(CFG, ("onnx", "float32", "cpu"), 64)


def test_a_columns_runner_is_freed_before_the_next_column_loads_even_in_a_reference_cycle(monkeypatch):
    """A process runs its columns one after another: the last one's runner goes before the next
    loads, where it sits in a reference cycle too (an ONNX runner's did: SmolLM2-135M's 1.9 GB stayed
    under the next column until the collector ran)."""
    import gc
    import weakref

    from conformance import cells
    from conformance.backends.numpy_backend import NumpyRunner

    freed, loaded_beside = [], []

    class Cyclic:
        def __init__(self):
            self.runner, self.itself = NumpyRunner(CFG, PARAMS, "float32"), self  # a cycle
            weakref.finalize(self, freed.append, True)

        def run(self, sublayer, inputs):
            return self.runner.run(sublayer, inputs)

    class Backend:
        def load(self, cfg, params, dtype, device):
            loaded_beside.append(len(freed))
            return Cyclic()

    monkeypatch.setattr(cells, "get_backend", lambda name: (Backend(), None))
    case = build_case(CFG, PARAMS, "forward", "none")
    reference, runners = golden_output(CFG, PARAMS, "forward", case.inputs), {}
    gc.disable()  # the collector may not run between the columns by chance
    try:
        for column in ("first", "second"):
            assert cells.run_cell(CFG, PARAMS, case, column, "float32", "cpu", reference, runners).status == PASS
    finally:
        gc.enable()
    assert loaded_beside == [0, 1]  # the first column's runner was gone when the second loaded


def test_a_column_the_memory_cannot_hold_is_skipped_for_the_memory_not_for_the_budget(monkeypatch):
    """A budget's plan leaves out a column the memory cannot hold: its cells say so, with the
    figures, rather than that the budget left them out (Qwen2.5-0.5B's shape at --memory 12G said
    the budget for 25 columns)."""
    from conformance.check import _fit

    # torch too large for its own cases, small where it runs none (as a footprint of no case was)
    monkeypatch.setattr(harness, "column_footprint", lambda cfg, column, longest:
                        50 * GB if column[0] == "torch" and Extent.of(longest).positions > 1 else GB)
    _available(monkeypatch, 20 * GB)
    plan = plan_matrix(CFG, ["numpy-float32", "torch"], ["float32"], ["cpu"])
    fitted, _ = _fit(CFG, PARAMS, plan, {"preset": "llama-tiny"}, 3600.0, False, "forward-none", None, 1)
    results = run_matrix(CFG, PARAMS, fitted, pattern="forward-none", jobs=1)
    assert {(r.backend, r.status, r.skip) for r in results} == {("numpy-float32", PASS, ""), ("torch", SKIP, TOO_LARGE)}


def test_a_column_runs_the_cases_the_memory_holds_where_its_longest_does_not_fit(monkeypatch):
    """A column whose longest case is over the memory still runs its shorter ones; the longest is
    skipped for the memory, with the figures (Qwen2.5-0.5B's shape at --memory 12G ran no cell:
    forward-long's 520 rows of 151,936 logits put every column over the limit)."""
    from conformance.check import _fit

    longest = harness.cell_extent(CFG, "forward", "long")
    assert longest.positions > harness.cell_extent(CFG, "forward", "none").positions
    monkeypatch.setattr(harness, "column_footprint", lambda cfg, column, extent:
                        50 * GB if column[0] == "torch" and Extent.of(extent).positions >= longest.positions else GB)
    _available(monkeypatch, 20 * GB)
    plan = plan_matrix(CFG, ["numpy-float32", "torch"], ["float32"], ["cpu"])
    fitted, _ = _fit(CFG, PARAMS, plan, {"preset": "llama-tiny"}, 3600.0, False, "forward-none|forward-long", None, 1)
    results = run_matrix(CFG, PARAMS, fitted, pattern="forward-none|forward-long", jobs=1)
    assert {(r.backend, r.mask_case): (r.status, r.skip) for r in results} == {
        ("numpy-float32", "none"): (PASS, ""), ("numpy-float32", "long"): (PASS, ""),
        ("torch", "none"): (PASS, ""), ("torch", "long"): (SKIP, TOO_LARGE)}
    assert "needs about 50.0 GB" in next(r.reason for r in results if r.skip == TOO_LARGE)


@pytest.mark.parametrize("preset", ["tiny", "llama-tiny"])
def test_a_decode_reference_is_the_whole_forwards_rows_from_its_first_step(preset):
    """The golden's decode reference runs the output head on the steps' rows only: the same numbers
    as the whole forward's logits sliced (an encoder-decoder and a decoder-only model)."""
    import numpy as np

    from conformance.backends.numpy_backend import NumpyRunner

    cfg = get_preset(preset)
    params = conformance_params(cfg)
    for mask_case in ("incremental", "pad_left", "far"):
        if mask_case == "far" and cfg.positional != "rope":
            continue
        case = build_case(cfg, params, "decode", mask_case)
        runner = NumpyRunner(cfg, params, "float64")
        whole = runner.run("forward", {"src_ids": case.inputs["src_ids"], "tgt_ids": case.inputs["tgt_ids"]})
        np.testing.assert_allclose(golden_output(cfg, params, "decode", case.inputs, runner),
                                   whole[:, case.inputs["prefix"]:], rtol=1e-12, atol=1e-12)


def test_a_check_asks_once_which_columns_export_first(monkeypatch):
    """Each asking hashes the weights per ONNX column: the plan carries the answer to the workers'
    count, the budget and the memory ledger."""
    from conformance import check

    asked = []

    def cold_columns(cfg, params, columns):
        asked.append(list(columns))
        return set()

    monkeypatch.setattr(check, "cold_columns", cold_columns)
    monkeypatch.setattr(harness, "cold_columns", cold_columns)
    _memory_of(monkeypatch, GB)
    run = check.check_model(preset="llama-tiny", backends=["numpy-float32", "torch"], dtypes=["float32"],
                            pattern="forward-none", budget=3600.0, memory=GB + 2 * WORKER_BYTES + int(2.5 * GB))
    assert run.counts["pass"] == 2 and len(asked) == 1
