"""Fixtures of the HTTP layer's tests."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _fresh(fresh_shared_redis: None) -> None:
    """Limiters here run on the shared Redis: start each test on an empty one (tests/conftest.py)."""
