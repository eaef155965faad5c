import os

# Under pytest-xdist (make test) each worker is one of the machine's cores: torch's OpenMP, the
# BLAS and XLA's thread pools would otherwise each start a thread per core in every worker, and
# the workers' threads spin against one another. Set before any test module imports a framework.
if "PYTEST_XDIST_WORKER" in os.environ:
    for variable in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ.setdefault(variable, "1")
    os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1")

from hypothesis import HealthCheck, settings

# CI keeps property tests bounded; `HYPOTHESIS_PROFILE=thorough pytest` explores more.
settings.register_profile("ci", max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("thorough", max_examples=300, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


import pytest  # noqa: E402 - after the thread settings above, which must precede any framework's import


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist's loadgroup (make test), a test that uses a fixture made once per module
    (a matrix run, a Ray cluster, models built) runs in the worker that holds it: every such test
    of a module is one group, the rest go to whichever worker is free.

    xdist 3.8 tells its scheduler a test's group by appending "@group" to the test's id, written
    into `item._nodeid`; pytest 9 reads a node's id from `item._id`, so that suffix never reached
    the scheduler and every group was spread over the workers (each building the module's matrix
    again: 195 s twice over in test_torch and test_jax). The suffix is written here where pytest
    reads it."""
    grouped = config.getvalue("dist") == "loadgroup" or bool(getattr(config.option, "loadgroup", False))
    for item in items:
        definitions = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
        if any(chain[-1].scope in ("module", "package", "session") for chain in definitions.values()):
            group = item.module.__name__
            item.add_marker(pytest.mark.xdist_group(group))
            if grouped and hasattr(item, "_id") and not item.nodeid.endswith(f"@{group}"):
                from _pytest.nodeid import coerce_node_id

                item._id = coerce_node_id(f"{item.nodeid}@{group}")


# ---- the suite's budget (issue 58) ---------------------------------------------------------------
# pytest's own time on CI's machine (2 cores, the README's `make test`), against which every run's
# summary states its time and its costliest modules, so that growth shows in the log where it happens.
SUITE_BUDGET_SECONDS = 600
_SECONDS_BY_MODULE: dict[str, float] = {}


def pytest_sessionstart(session):
    import time

    session.config._suite_started = time.monotonic()


def pytest_runtest_logreport(report):
    """Each test's setup, call and teardown, summed by module (the controller receives the workers')."""
    module = report.nodeid.split("::")[0]
    _SECONDS_BY_MODULE[module] = _SECONDS_BY_MODULE.get(module, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter, config):
    import time

    if "PYTEST_XDIST_WORKER" in os.environ or not _SECONDS_BY_MODULE:
        return
    took = time.monotonic() - config._suite_started
    costliest = sorted(_SECONDS_BY_MODULE.items(), key=lambda item: -item[1])[:10]
    terminalreporter.write_sep("-", "the suite's budget")
    terminalreporter.write_line(
        f"pytest took {took:.0f} s of its budget of {SUITE_BUDGET_SECONDS} s on CI's 2 cores "
        f"({sum(_SECONDS_BY_MODULE.values()):.0f} s of tests across the workers)"
        + ("; OVER BUDGET: move a check onto the presets that carry its feature (issue 58)"
           if took > SUITE_BUDGET_SECONDS else ""))
    terminalreporter.write_line("costliest modules: " + ", ".join(f"{module.removeprefix('tests/')} {seconds:.0f} s"
                                                                  for module, seconds in costliest))
