import os

from hypothesis import HealthCheck, settings

# CI keeps property tests bounded; `HYPOTHESIS_PROFILE=thorough pytest` explores more.
settings.register_profile("ci", max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("thorough", max_examples=300, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
