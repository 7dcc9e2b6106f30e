"""Argument types and the parser class of the ``geolimit`` command line.

A value out of range is a usage error found while parsing (exit 2), before anything
starts, and its message names the flag: ``geolimit try: error: argument --times: must be
a whole number of at least 1, got '-1' (see 'geolimit try --help')``.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from typing import NoReturn

__all__ = [
    "CliParser", "cost", "int_at_least", "int_within", "local_host", "positive_seconds", "positive_seconds_up_to",
    "quiet_broken_pipe", "rate", "region", "seconds_within", "tcp_port",
]


class CliParser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line on stderr (exit code 2)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def _int(text: str, expected: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {expected}, got {text!r}") from None


def int_at_least(minimum: int) -> Callable[[str], int]:
    """An argument type: an integer >= ``minimum``."""

    def parse(text: str) -> int:
        expected = f"a whole number of at least {minimum}"
        value = _int(text, expected)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be {expected}, got {text!r}")
        return value

    return parse


def int_within(minimum: int, maximum: int) -> Callable[[str], int]:
    """An argument type: an integer from ``minimum`` to ``maximum``, both included."""

    def parse(text: str) -> int:
        expected = f"a whole number from {minimum} to {maximum}"
        value = _int(text, expected)
        if not minimum <= value <= maximum:
            raise argparse.ArgumentTypeError(f"must be {expected}, got {text!r}")
        return value

    return parse


def cost(text: str) -> int:
    """An argument type: the cost of a hit, 0 to 2**46 (what the limiter and the agent accept)."""
    from geolimit.store.protocol import MAX_COST

    expected = f"a whole number from 0 to 2**46 ({MAX_COST})"
    value = _int(text, expected)
    if not 0 <= value <= MAX_COST:
        raise argparse.ArgumentTypeError(f"must be {expected}, got {text!r}")
    return value


def tcp_port(text: str) -> int:
    """An argument type: a TCP port, 1 to 65535."""
    expected = "a TCP port from 1 to 65535 (leave the flag out to get a free one)"
    value = _int(text, expected)
    if not 0 < value < 65536:
        raise argparse.ArgumentTypeError(f"must be {expected}, got {text!r}")
    return value


def rate(text: str) -> str:
    """An argument type: a rate string such as ``5/10s`` or ``10/hour;5/minute`` (returned as is)."""
    from geolimit.core.rule import parse_rates, window_label
    from geolimit.errors import ConfigError

    try:
        labels = [window_label(window) for _, window in parse_rates(text)]
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    twice = [label for i, label in enumerate(labels) if label in labels[:i]]
    if twice:
        raise argparse.ArgumentTypeError(f"invalid rate {text!r}: two limits over the same window ({twice[0]}); "
                                         "keep the stricter one")
    return text


def region(text: str) -> str:
    """An argument type: a region name (1-64 characters from A-Z a-z 0-9 _ . -)."""
    from geolimit.errors import ConfigError
    from geolimit.limiter_base import validate_region

    try:
        return validate_region(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def local_host(text: str) -> str:
    """An argument type: an address of this machine that a server can bind (a name is resolved)."""
    import socket

    expected = "an address of this machine, such as 127.0.0.1 (loopback) or 0.0.0.0 (every interface)"
    if not text.strip():
        raise argparse.ArgumentTypeError(f"must be {expected}, got {text!r}")
    with socket.socket(socket.AF_INET6 if ":" in text else socket.AF_INET) as sock:  # as redis-server binds it
        try:
            sock.bind((text, 0))
        except socket.gaierror as exc:
            raise argparse.ArgumentTypeError(f"must be {expected}, got {text!r}: cannot resolve it ({exc.strerror})") from None
        except (OSError, OverflowError, ValueError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise argparse.ArgumentTypeError(f"must be {expected}, got {text!r}, not a local address ({reason})") from None
    return text


def _seconds(text: str, expected: str, accept: Callable[[float], bool]) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {expected}, got {text!r}") from None
    if not (math.isfinite(value) and accept(value)):  # nan and inf are never a duration
        raise argparse.ArgumentTypeError(f"must be {expected}, got {text!r}")
    return value


def positive_seconds(text: str) -> float:
    """An argument type: a finite number of seconds greater than 0."""
    return _seconds(text, "a number of seconds greater than 0, such as 5 or 0.5", lambda value: value > 0)


def positive_seconds_up_to(maximum: float) -> Callable[[str], float]:
    """An argument type: a finite number of seconds greater than 0 and at most ``maximum``."""
    expected = f"a number of seconds greater than 0 and at most {maximum:g}, such as 5 or 0.5"

    def parse(text: str) -> float:
        return _seconds(text, expected, lambda value: 0 < value <= maximum)

    return parse


def seconds_within(minimum: float, maximum: float = math.inf) -> Callable[[str], float]:
    """An argument type: a finite number of seconds from ``minimum`` to ``maximum``, both included."""
    if math.isfinite(maximum):
        expected = f"a number of seconds from {minimum:g} to {maximum:g}"
    else:
        expected = f"a number of seconds of at least {minimum:g}"

    def parse(text: str) -> float:
        return _seconds(text, expected, lambda value: minimum <= value <= maximum)

    return parse


def quiet_broken_pipe() -> int:
    """After stdout's reader went away (``geolimit status --json | head -c 10``): point
    stdout at /dev/null so the interpreter's last flush is silent, and return 141, the
    status a shell reports for a command ended by SIGPIPE."""
    import os

    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # stdout is not a file descriptor (tests)
        pass
    return 141
