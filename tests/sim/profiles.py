"""Hypothesis settings of the simulation property tests.

``ci`` runs with every ``pytest``; ``nightly`` (many more schedules) runs only under
``pytest -m nightly`` (tests marked ``nightly`` are deselected unless the ``-m``
expression names the marker; see tests/conftest.py). The settings apply only to
the tests under tests/sim (``@settings(SIM_SETTINGS[...])``), so they change nothing
for the rest of the suite's hypothesis tests.
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings

EXAMPLES = {"ci": 40, "nightly": 500}  # schedules of the main property test (the crash test runs half)

SIM_SETTINGS = {
    name: settings(
        max_examples=examples,
        deadline=None,  # an example runs a whole simulated cluster (real Redis)
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        print_blob=True,
    )
    for name, examples in EXAMPLES.items()
}
#: pytest-timeout per property test (the suite's default of 120 s is for one example's worth)
TIMEOUT = {name: max(120, 6 * examples) for name, examples in EXAMPLES.items()}
