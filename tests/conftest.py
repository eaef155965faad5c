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


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist's loadgroup (make test), a test that uses a fixture made once per module
    (a matrix run, a Ray cluster, models built) runs in the worker that holds it: every such test
    of a module is one group, the rest go to whichever worker is free."""
    import pytest

    for item in items:
        definitions = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
        if any(chain[-1].scope in ("module", "package", "session") for chain in definitions.values()):
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))
