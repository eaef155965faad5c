"""Columns in worker processes (conformance.executors.local_pool): the same cells, order and verdicts as
one process; a backend registered with a callable stays in the calling process; a worker that
dies turns its unfinished cells into errors that say why, and the other columns still run;
fail-fast stops the workers."""

from __future__ import annotations

import pytest

from conformance.adapter import register_backend, unregister_backend
from conformance.byo import CustomBackend  # noqa: F401 - registered with a callable below
from rosetta.main import main
from conformance.cases import case_names
from conformance.harness import ERROR, FAIL, PASS, plan_matrix, run_matrix
from conformance.executors.local_pool import auto_jobs
from conformance.tolerance import SAFETY
from spec import get_preset, conformance_params

CFG = get_preset("tiny")
PARAMS = conformance_params(CFG, seed=0)
CASES = len(case_names(CFG))  # the forward cases of a column (103)


@pytest.fixture
def extra_backends():
    register_backend("crashing", "tests.parallel_backends:CrashingBackend")
    register_backend("zeros", "tests.parallel_backends:ZerosBackend")
    yield
    unregister_backend("crashing")
    unregister_backend("zeros")


def _plan(backends):
    return plan_matrix(CFG, backends, ["float32", "float16"], ["cpu"])


@pytest.mark.slow
def test_workers_give_the_sequential_results():
    plan = _plan(["numpy-float32", "torch"])
    one = run_matrix(CFG, PARAMS, plan, jobs=1)
    two = run_matrix(CFG, PARAMS, plan, jobs=2)
    assert [(r.test_id, r.status) for r in one] == [(r.test_id, r.status) for r in two], \
        [(a.test_id, a.status, b.status, a.reason or b.reason) for a, b in zip(one, two) if a.status != b.status][:3]
    assert sum(r.status == PASS for r in two) == 3 * CASES  # numpy f32, torch f32 and f16
    # A worker runs with fewer threads, so its sums are split (and rounded) in another order. The
    # tolerance is SAFETY times the computation's rounding (SPEC §8); rounded again in another order,
    # that rounding lands anywhere within itself, so two runs' errors differ by at most twice it.
    for a, b in zip(one, two):
        assert (a.max_abs_err is None) == (b.max_abs_err is None)
        if a.max_abs_err is not None:
            assert a.tol == b.tol and abs(a.max_abs_err - b.max_abs_err) <= 2 / SAFETY * a.tol, a.test_id


def test_a_dying_worker_gives_errors_and_the_rest_runs(extra_backends):
    progress = []
    results = run_matrix(CFG, PARAMS, _plan(["crashing", "numpy-float32"]), jobs=2,
                         progress=lambda result, done, total: progress.append((done, total)))
    crashed = [r for r in results if r.backend == "crashing" and r.dtype == "float32"]  # float16: skipped
    assert [r.status for r in crashed[:3]] == [PASS] * 3
    assert {r.status for r in crashed[3:]} == {ERROR} and len(crashed) == CASES
    assert "died (exit code 3: simulated crash)" in crashed[3].reason
    assert {r.status for r in results if r.backend == "numpy-float32" and r.dtype == "float32"} == {PASS}
    assert progress[-1] == (2 * CASES, 2 * CASES) and len(progress) == 2 * CASES


def test_fail_fast_stops_the_workers(extra_backends):
    results = run_matrix(CFG, PARAMS, _plan(["zeros", "numpy-float32"]), jobs=2, fail_fast=True)
    ran = [r for r in results if r.status in (PASS, FAIL, ERROR)]
    # the other column's cells that finished before the stop are kept, in their order
    assert [r.status for r in ran if r.backend == "zeros"] == [FAIL] and len(ran) < 2 * CASES


def test_a_backend_registered_with_a_callable_runs_here():
    from conformance.backends.numpy_backend import NumpyFloat32Backend

    register_backend("numpy-here", NumpyFloat32Backend)
    try:
        results = run_matrix(CFG, PARAMS, _plan(["numpy-here"]), jobs=2, pattern="mha-*")
    finally:
        unregister_backend("numpy-here")
    assert {r.status for r in results if r.dtype == "float32"} == {PASS}


@pytest.fixture
def siblings(tmp_path, monkeypatch):
    """Three backends of one program family; the file each load is noted in."""
    names = {"sibling": "SiblingBackend", "other-sibling": "OtherSiblingBackend",
             "crashing-sibling": "CrashingSiblingBackend"}
    for name, factory in names.items():
        register_backend(name, f"tests.parallel_backends:{factory}")
    monkeypatch.setenv("ROSETTA_TEST_LOAD_NOTES", str(tmp_path / "loads"))
    yield tmp_path / "loads"
    for name in names:
        unregister_backend(name)


def test_columns_of_one_program_family_run_in_one_worker(siblings):
    """jax and jax-math share their programs: a dtype's two columns go to one worker, in turn."""
    from conformance.executors import column_groups

    columns = [("sibling", "float32", "cpu"), ("numpy-float32", "float32", "cpu"),
               ("other-sibling", "float32", "cpu"), ("sibling", "float16", "cpu")]
    assert column_groups(columns) == [[columns[0], columns[2]], [columns[1]], [columns[3]]]
    assert [len(group) for group in column_groups([("jax", "float32", "cpu"), ("jax-math", "float32", "cpu"),
                                                   ("jax-math", "float64", "cpu")])] == [2, 1]
    results = run_matrix(CFG, PARAMS, _plan(["sibling", "numpy-float32", "other-sibling"]), jobs=2)
    assert {r.status for r in results if r.dtype == "float32"} == {PASS}, \
        {r.test_id: r.reason for r in results if r.dtype == "float32" and r.status != PASS}
    loads = [line.split() for line in siblings.read_text().splitlines()]
    assert sorted(name for name, _, _ in loads) == ["other-sibling", "sibling"]
    assert loads[0][2] == loads[1][2]  # one process


def test_an_exporters_columns_of_every_dtype_share_one_worker():
    """onnx's float32 and float16 exports share torch.onnx's start-up (family_spans_dtypes); the
    onnx-jax columns are another exporter's group; the longest groups are handed out first."""
    from conformance.executors import column_groups, cost_rank

    columns = [("onnx", "float32", "cpu"), ("onnx-jax", "float32", "cpu"), ("onnx", "float16", "cpu"),
               ("onnx-jax", "float16", "cpu"), ("onnx", "float32", "cuda")]
    assert column_groups(columns) == [[columns[0], columns[2]], [columns[1], columns[3]], [columns[4]]]
    order = [("torch", "float32", "cpu"), ("jax", "float64", "cpu"), ("jax", "bfloat16", "cpu"),
             ("onnx", "float32", "cpu"), ("my-plugin", "float32", "cpu")]
    assert sorted(order, key=cost_rank) == [order[3], order[2], order[1], order[0], order[4]]


def test_a_worker_dying_inside_a_group_leaves_the_rest_of_the_group_to_another(siblings):
    results = run_matrix(CFG, PARAMS, _plan(["crashing-sibling", "sibling", "numpy-float32"]), jobs=2)
    crashed = [r for r in results if r.backend == "crashing-sibling" and r.dtype == "float32"]
    assert [r.status for r in crashed[:3]] == [PASS] * 3 and {r.status for r in crashed[3:]} == {ERROR}
    for name in ("sibling", "numpy-float32"):
        assert {r.status for r in results if r.backend == name and r.dtype == "float32"} == {PASS}


def test_auto_jobs(monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    cpu = [("torch", "float32", "cpu"), ("jax", "float32", "cpu"), ("jax", "float16", "cpu")]
    assert auto_jobs(cpu) == 2
    assert auto_jobs(cpu[:1]) == 1
    assert auto_jobs([*cpu, ("torch", "float32", "cuda")]) == 1  # one process per GPU


@pytest.mark.parametrize("jobs", ["0", "-1", "two"])
def test_jobs_must_be_positive(jobs, capsys):
    assert main(["check", "--backends", "numpy-float32", "--jobs", jobs]) == 2
    assert "--jobs takes a positive integer or auto" in capsys.readouterr().err


def test_a_pool_started_ahead_runs_the_matrix_and_is_closed():
    """Workers started before the plan (importing their frameworks, and a name that is not a
    backend, meanwhile) give the sequential results; afterwards no process is left."""
    from conformance.executors.local_pool import WorkerPool

    pool = WorkerPool(3, preload=["numpy-float32", "torch", "no-such-backend"])
    plan = _plan(["numpy-float32", "torch"])  # three columns: numpy float32, torch float32 and float16
    results = run_matrix(CFG, PARAMS, plan, jobs=2, pool=pool, pattern="mha-*")
    assert [(r.test_id, r.status) for r in results] == [
        (r.test_id, r.status) for r in run_matrix(CFG, PARAMS, plan, jobs=1, pattern="mha-*")]
    assert [r.status for r in results].count(PASS) == 3 * 14
    assert len(pool.workers) == 2  # the third was closed unused
    assert all(worker.process.poll() is not None for worker in pool.workers)


def test_a_pool_is_closed_when_the_run_needs_no_worker():
    from conformance.executors.local_pool import WorkerPool

    pool = WorkerPool(2)
    run_matrix(CFG, PARAMS, _plan(["numpy-float32"]), jobs=1, pattern="mha-none-*")
    run_matrix(CFG, PARAMS, _plan(["numpy-float32"]), jobs=1, pool=pool, pattern="mha-none-*")
    assert all(worker.process.poll() is not None for worker in pool.workers)


def test_workers_are_started_early_only_where_the_run_will_use_them(monkeypatch, tmp_path):
    import rosetta.check as cli

    monkeypatch.setattr(cli, "NVIDIA_DRIVER", tmp_path / "absent")
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    started = []
    monkeypatch.setattr(cli, "WorkerPool", lambda count, preload: started.append((count, list(preload))) or "pool")
    assert cli._early_workers(None, ["numpy-float32", "torch"], None, None) == "pool"
    assert started[-1] == (2, ["numpy-float32", "torch"])
    assert cli._early_workers(1, None, None, None) is None  # --jobs 1: one process
    assert cli._early_workers(None, None, None, ["cuda"]) is None  # a GPU column: one process
    assert cli._early_workers(None, ["torch"], ["float32"], None) is None  # one column: no worker at all
    # --memory: the plan counts the workers (as many as the columns it holds at once); a --jobs given is kept
    assert cli._early_workers(None, ["numpy-float32", "torch"], None, None, memory=6 * 10 ** 9) is None
    assert cli._early_workers(2, ["numpy-float32", "torch"], None, None, memory=6 * 10 ** 9) == "pool"
    (tmp_path / "driver").write_text("NVRM version: 580.95.05")
    monkeypatch.setattr(cli, "NVIDIA_DRIVER", tmp_path / "driver")
    assert cli._early_workers(None, None, None, None) is None  # every device present: a GPU here
    assert cli._early_workers(None, None, None, ["cpu"]) == "pool"
    monkeypatch.setattr("os.cpu_count", lambda: 1)
    assert cli._early_workers(None, None, None, ["cpu"]) is None


def test_a_case_a_worker_cannot_make_is_an_error_cell_and_the_column_goes_on():
    """Before, an exception while a worker made a case or its reference ended the process, and
    every cell left in its column read only that 'the worker process died'."""
    from conformance.executors.local_pool import run_in_workers

    results = {}
    column = ("numpy-float32", "float32", "cpu")
    work = [(0, "grad-attention-no_such_case", column), (1, "attention-none", column)]
    run_in_workers(CFG, PARAMS, work, 1, lambda index, result: results.__setitem__(index, result))
    assert (results[0].status, results[0].sublayer, results[0].mask_case) == (ERROR, "grad-attention", "no_such_case")
    assert "could not be made" in results[0].reason and "no_such_case" in results[0].reason, results[0].reason
    assert results[1].status == PASS
