"""Hypothesis profiles of the simulation property tests.

``GEOLIMIT_HYPOTHESIS_PROFILE=ci`` (the default) or ``nightly`` selects one. The
profiles are registered as ``geolimit-sim-<name>`` and applied only to the tests
under tests/sim (``@settings(SIM_SETTINGS)``), so they change nothing for the rest
of the suite's hypothesis tests.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

ENV = "GEOLIMIT_HYPOTHESIS_PROFILE"
EXAMPLES = {"ci": 40, "nightly": 500}  # schedules of the main property test (the crash test runs half)

for _name, _examples in EXAMPLES.items():
    settings.register_profile(
        f"geolimit-sim-{_name}",
        max_examples=_examples,
        deadline=None,  # an example runs a whole simulated cluster (real Redis)
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        print_blob=True,
    )

PROFILE = os.environ.get(ENV, "ci").strip() or "ci"
if PROFILE not in EXAMPLES:
    raise ValueError(f"{ENV}={PROFILE!r}: expected one of {sorted(EXAMPLES)}")
SIM_SETTINGS = settings.get_profile(f"geolimit-sim-{PROFILE}")
#: pytest-timeout per property test (the suite's default of 120 s is for one example's worth)
TIMEOUT = max(120, 6 * EXAMPLES[PROFILE])
