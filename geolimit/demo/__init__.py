"""``geolimit demo``: several regions on this machine, a partition, a plot (see :mod:`geolimit.demo.run`)."""

from geolimit.demo.run import run_demo

__all__ = ["run_demo"]
