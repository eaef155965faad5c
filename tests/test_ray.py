"""The Ray executor (conformance.executors.ray_cluster) on a local cluster of two fake nodes: the
head (2 CPUs) and a node with 1 CPU and one fake H100 (a GPU resource with Ray's
accelerator_type:H100, no device behind it). The same cells as the local run; CUDA columns on
the GPU node; a crashing column gives errors and the run goes on; a column no node can hold is
skipped at once; nodes of different versions are refused."""

from __future__ import annotations

import threading

import pytest

from conformance.adapter import register_backend, unregister_backend
from conformance.executors.ray_cluster import (cluster_devices, column_requirement, unplaceable_reason,
                                               unreachable, version_mismatches)
from conformance.harness import ERROR, PASS, SKIP, plan_matrix, run_matrix
from conformance.tolerance import SAFETY
from spec import conformance_params, get_preset

try:
    import ray
except ImportError:  # Ray is an optional extra (pip install '.[ray]'); the test extra has it
    ray = None

CFG = get_preset("tiny")
PARAMS = conformance_params(CFG, seed=0)


# ---- the pure parts ------------------------------------------------------------------------

def test_a_column_asks_for_a_cpu_or_a_gpu_of_its_kind():
    assert column_requirement(("torch", "float32", "cpu")) == {"CPU": 1.0}
    assert column_requirement(("torch", "float16", "cuda")) == {"GPU": 1.0}
    assert column_requirement(("torch", "float16", "cuda"), "H100") == {"GPU": 1.0, "accelerator_type:H100": 0.001}


def test_a_requirement_no_node_holds_is_named():
    cpu_only, h100 = {"CPU": 8.0}, {"CPU": 4.0, "GPU": 1.0, "accelerator_type:H100": 1.0}
    assert unplaceable_reason({"CPU": 1.0}, [cpu_only]) is None
    assert unplaceable_reason({"GPU": 1.0}, [cpu_only]) == "no node with a GPU in the Ray cluster"
    assert unplaceable_reason({"GPU": 1.0, "accelerator_type:H100": 0.001}, [cpu_only, h100]) is None
    assert (unplaceable_reason({"GPU": 1.0, "accelerator_type:A100": 0.001}, [cpu_only, h100])
            == "no node with GPU type A100 in the Ray cluster")
    # the resources must be on one node, not spread over two
    assert unplaceable_reason({"GPU": 1.0, "accelerator_type:H100": 0.001}, [{"GPU": 1.0}, {"accelerator_type:H100": 1.0}])
    assert cluster_devices([cpu_only]) == ["cpu"] and cluster_devices([cpu_only, h100]) == ["cpu", "cuda"]


def test_nodes_of_different_versions_are_named_field_by_field():
    same = {"transformer-rosetta": "0.1.0", "python": "3.11.7", "torch": "2.13.0"}
    assert version_mismatches({"a": same, "b": dict(same)}) == []
    planted = {"a": same, "b": {**same, "torch": "2.11.0"}, "c": {**same, "python": "3.12.1"}}
    assert version_mismatches(planted) == ["torch: 2.11.0 on b, 2.13.0 on a", "python: 3.12.1 on c, 3.11.7 on a"]


def test_an_address_nothing_answers_at_is_named_before_ray_retries_for_minutes():
    import socket

    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        port = listening.getsockname()[1]
        assert unreachable(f"127.0.0.1:{port}") is None and unreachable(f"ray://127.0.0.1:{port}") is None
    assert unreachable(f"127.0.0.1:{port}") == f"nothing answers at 127.0.0.1:{port} (Connection refused)"
    assert unreachable("auto") is None  # Ray finds that one itself, and says so at once when there is none


def test_rosetta_check_names_an_address_with_no_cluster(capsys):
    """Before the module's cluster starts: an initialized Ray is used whatever the address."""
    if ray is None:
        pytest.skip("Ray is not installed (pip install '.[ray]')")
    from rosetta.main import main

    assert main(["check", "--backends", "numpy-float32", "--executor", "ray", "--address", "127.0.0.1:1"]) == 2
    assert "no Ray cluster at 127.0.0.1:1: nothing answers at 127.0.0.1:1 (Connection refused)" in capsys.readouterr().err


# ---- on a local cluster of fake nodes --------------------------------------------------------

@pytest.fixture(scope="module")
def cluster():
    """One local cluster for this module: the head, and a node with a fake H100. Yields the
    GPU node's id."""
    if ray is None:
        pytest.skip("Ray is not installed (pip install '.[ray]')")
    import os

    from ray.cluster_utils import Cluster

    usage_stats = os.environ.get("RAY_USAGE_STATS_ENABLED")
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"  # read by every node the cluster starts
    small = {"object_store_memory": 80 * 1024**2, "include_dashboard": False}
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, **small})
    gpu_node = cluster.add_node(num_cpus=1, num_gpus=1, resources={"accelerator_type:H100": 1.0}, **small)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
    yield gpu_node.node_id
    ray.shutdown()
    cluster.shutdown()
    if usage_stats is None:
        del os.environ["RAY_USAGE_STATS_ENABLED"]
    else:
        os.environ["RAY_USAGE_STATS_ENABLED"] = usage_stats


@pytest.fixture
def test_backends():
    names = {"gpu-label": "tests.ray_backends:GpuLabelBackend",
             "writes-its-inputs": "tests.ray_backends:WritesItsInputsBackend",
             "crashing-sibling": "tests.parallel_backends:CrashingSiblingBackend",
             "sibling": "tests.parallel_backends:SiblingBackend"}
    for name, path in names.items():
        register_backend(name, path)
    yield
    for name in names:
        unregister_backend(name)


def _executor(accelerator=None):
    from conformance.executors.ray_cluster import RayCluster

    return RayCluster(accelerator=accelerator)


def _within_time(seconds, run):
    """run() in a thread; a failure, not a hung suite, where it takes longer than `seconds`."""
    answer = {}
    thread = threading.Thread(target=lambda: answer.setdefault("value", run()), daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"the run did not end within {seconds} s"
    return answer["value"]


@pytest.mark.slow
def test_ray_gives_the_local_cells(cluster):
    plan = plan_matrix(CFG, ["numpy-float32", "torch"], ["float32", "float16"], ["cpu"])
    executor = _executor()
    on_ray = run_matrix(CFG, PARAMS, plan, executor=executor)
    here = run_matrix(CFG, PARAMS, plan)
    assert [r.test_id for r in on_ray] == [r.test_id for r in here]
    assert {r.status for r in here} == {PASS, SKIP}  # numpy-float32 runs no float16
    for a, b in zip(on_ray, here):
        assert a.status == b.status and a.reason == b.reason, a.test_id
        if a.status == SKIP:
            continue
        # torch's thread count (one CPU an actor) splits its sums in another order: the rounding,
        # the tolerance over SAFETY (SPEC §8), lands anywhere within itself, so the errors differ
        # by at most twice it (tests/test_parallel.py)
        assert a.tol == b.tol and abs(a.max_abs_err - b.max_abs_err) <= 2 / SAFETY * a.tol, a.test_id
    nodes = {node["NodeID"] for node in ray.nodes()}
    assert set(executor.placements) == {"numpy-float32/float32/cpu", "torch/float32/cpu", "torch/float16/cpu"}
    for where in executor.placements.values():
        assert where["node_id"] in nodes and where["versions"]["torch"] and where["gpu_ids"] == []


def test_cuda_columns_go_to_the_gpu_node_and_cpu_columns_ask_for_a_cpu(cluster, test_backends):
    executor = _executor("H100")
    assert executor.devices() == ["cpu", "cuda"] and len(executor.versions) == 2  # both nodes answered
    plan = plan_matrix(CFG, ["gpu-label", "numpy-float32"], ["float32"], ["cpu", "cuda"],
                       cluster_devices=executor.devices())
    assert ("gpu-label", "float32", "cuda") in plan.columns  # this machine has no GPU: the cluster has
    results = run_matrix(CFG, PARAMS, plan, executor=executor)
    assert {r.status for r in results if r.backend == "gpu-label"} == {PASS}
    where = executor.placements["gpu-label/float32/cuda"]
    assert where["node_id"] == cluster and where["gpu_ids"] == ["0"]
    # numpy's CUDA column was refused when planned, by the backend itself
    assert {r.reason for r in results if r.backend == "numpy-float32" and r.device == "cuda"} == {
        "NumPy runs on the CPU only, not cuda"}


def test_a_column_whose_backend_does_not_see_the_device_on_its_node_is_skipped(cluster):
    executor = _executor()
    plan = plan_matrix(CFG, ["torch"], ["float32"], ["cuda"], cluster_devices=executor.devices())
    results = run_matrix(CFG, PARAMS, plan, executor=executor, pattern="ffn-*")
    assert results and {r.status for r in results} == {SKIP}
    assert results[0].reason.startswith("device cuda not present for torch on ")  # a fake GPU: torch sees none


def test_a_column_no_node_can_hold_is_skipped_not_waited_for(cluster, test_backends):
    executor = _executor("A100")
    plan = plan_matrix(CFG, ["gpu-label"], ["float32"], ["cpu", "cuda"], cluster_devices=executor.devices())
    results = _within_time(60, lambda: run_matrix(CFG, PARAMS, plan, executor=executor))
    skipped = [r for r in results if r.device == "cuda"]
    assert skipped and {(r.status, r.reason) for r in skipped} == {(SKIP, "no node with GPU type A100 in the Ray cluster")}
    assert {r.status for r in results if r.device == "cpu"} == {PASS}


def test_a_crashing_column_gives_errors_that_quote_ray_and_the_run_goes_on(cluster, test_backends):
    """crashing-sibling's process exits at its fourth cell; sibling, of its program family and so
    of its actor, goes on in a new actor; numpy-float32 is untouched. Nothing is retried."""
    plan = plan_matrix(CFG, ["crashing-sibling", "sibling", "numpy-float32"], ["float32"], ["cpu"])
    results = _within_time(120, lambda: run_matrix(CFG, PARAMS, plan, executor=_executor()))
    crashed = [r for r in results if r.backend == "crashing-sibling"]
    # one cell in flight per actor: the three answers before the crash were in hand, under any load
    statuses = [r.status for r in crashed]
    passed = 3
    assert statuses == [PASS] * passed + [ERROR] * (len(statuses) - passed)
    assert crashed[passed].reason.startswith("the Ray actor running this column died (")
    assert "exit" in crashed[passed].reason.lower()  # Ray's own detail of how the process ended
    for name in ("sibling", "numpy-float32"):
        assert {r.status for r in results if r.backend == name} == {PASS}


def test_arrays_from_the_object_store_are_copied_before_a_backend_writes_into_them(cluster, test_backends):
    plan = plan_matrix(CFG, ["writes-its-inputs"], ["float32"], ["cpu"])
    results = run_matrix(CFG, PARAMS, plan, executor=_executor(), pattern="*-none-*")
    assert results and {r.status for r in results} == {PASS}, {r.reason for r in results}


# ---- the command line ----------------------------------------------------------------------

def test_rosetta_check_on_ray_reports_where_each_column_ran(cluster, tmp_path, capsys):
    import json

    from rosetta.main import main

    assert main(["check", "--preset", "tiny", "--backends", "numpy-float32", "--executor", "ray", "-k", "ffn-",
                 "--report", str(tmp_path), "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "where each column ran:\n  numpy-float32/float32/cpu: " in out
    report = json.loads((tmp_path / "report.json").read_text())
    where = report["placements"]["numpy-float32/float32/cpu"]
    assert where["node_id"] in {node["NodeID"] for node in ray.nodes()} and where["versions"]["numpy"]
    assert "## Where each column ran" in (tmp_path / "report.md").read_text()


@pytest.mark.parametrize("argv, message", [
    (["--address", "auto"], "--address and --accelerator name a Ray cluster: give them with --executor ray"),
    (["--executor", "ray", "--jobs", "2"], "--jobs counts the local executor's worker processes"),
])
def test_ray_flags_out_of_place_are_refused(argv, message, capsys):
    from rosetta.main import main

    assert main(["check", "--backends", "numpy-float32", *argv]) == 2
    assert message in capsys.readouterr().err


def test_without_ray_the_executor_is_reported_unavailable(monkeypatch, capsys):
    import sys

    from rosetta.main import main

    monkeypatch.setitem(sys.modules, "ray", None)  # import ray raises ImportError
    assert main(["check", "--backends", "numpy-float32", "--executor", "ray"]) == 2
    assert "the ray executor needs Ray, which is not installed here: pip install '.[ray]'" in capsys.readouterr().err


def test_rosetta_check_refuses_a_cluster_of_mixed_versions(cluster, monkeypatch, capsys):
    from conformance.executors import ray_cluster
    from rosetta.main import main

    monkeypatch.setattr(ray_cluster.RayCluster, "fingerprints",
                        lambda self: {"a": {"python": "3.11.7"}, "b": {"python": "3.12.1"}})
    assert main(["check", "--backends", "numpy-float32", "--executor", "ray"]) == 2
    err = capsys.readouterr().err
    assert "the Ray cluster's nodes run different versions" in err and "python: 3.12.1 on b, 3.11.7 on a" in err
