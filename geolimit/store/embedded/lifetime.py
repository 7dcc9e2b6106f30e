"""Embedded ``redis-server`` children end with the Python process that started them.

* Normal interpreter exit (also after Ctrl-C's ``KeyboardInterrupt``, and after an
  application's own SIGTERM handler ended the program): an :mod:`atexit` hook stops every
  server this process started, which also removes its temporary directory.
* SIGTERM or SIGHUP whose disposition is still the default would kill the process without
  running atexit. While a server runs, such a signal gets a handler that stops the servers
  and then dies of the same signal, exactly as it would have: same exit status, no
  exception raised into the application. It is only installed from the main thread and
  only over the default disposition: a handler the application set before is left alone.
  An application that sets its own afterwards replaces it; uvicorn restores it at the end
  of its graceful shutdown and re-raises the signal, which lands here. It is removed again
  when the last server stops.
* On Linux, ``PR_SET_PDEATHSIG`` SIGKILLs a server whose Python process died with no
  chance to clean up (SIGKILL); its temporary directory then stays behind.

Servers are stopped only by the process that started them: a forked child that exits or
gets SIGTERM leaves its parent's servers alone. The child starts with the default
disposition back; the signals are blocked across ``fork()`` so that one sent right after it
is not lost (Python clears a child's pending signal flags) but kills the child.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import signal
import sys
import threading
from collections.abc import Callable
from types import FrameType
from typing import Protocol

__all__ = ["forget", "pdeathsig_preexec", "remember", "stop_all", "unclaimed"]

_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


class Stoppable(Protocol):
    def stop(self) -> None: ...


_LIVE: dict[Stoppable, int] = {}  # server -> pid of the process that started it


def remember(server: Stoppable) -> None:
    """Stop ``server`` when this process exits or gets SIGTERM/SIGHUP (see the module doc)."""
    _LIVE[server] = os.getpid()
    _install_handlers()


def forget(server: Stoppable) -> None:
    """``server`` stopped: no longer stop it at exit; the last one removes the handlers."""
    _LIVE.pop(server, None)
    if not _owned():
        _remove_handlers()


def _owned() -> list[Stoppable]:
    pid = os.getpid()
    return [server for server, owner in _LIVE.copy().items() if owner == pid]


@atexit.register
def stop_all() -> None:
    """Stop every server this process started (never a forked parent's)."""
    for server in _owned():
        with contextlib.suppress(Exception):
            server.stop()


def _stop_then_die(signum: int, frame: FrameType | None) -> None:
    """Stop this process's servers, then die of ``signum`` as its default disposition would."""
    try:
        stop_all()
    finally:
        signal.signal(signum, signal.SIG_DFL)
        signal.raise_signal(signum)


def unclaimed(sig: int) -> bool:
    """True if nothing but this module handles ``sig``: its default disposition, or the
    stop-then-die handler set over it. Code that installs its own handler only when nobody
    else handles the signal can test this rather than ``getsignal(sig) is SIG_DFL``."""
    handler = signal.getsignal(sig)
    return handler == signal.SIG_DFL or handler is _stop_then_die


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def _install_handlers() -> None:
    if not _in_main_thread():  # signal.signal works in the main thread only
        return
    for sig in _SIGNALS:
        with contextlib.suppress(ValueError, OSError):
            if unclaimed(sig):
                signal.signal(sig, _stop_then_die)


def _remove_handlers() -> None:
    if not _in_main_thread():
        return
    for sig in _SIGNALS:
        with contextlib.suppress(ValueError, OSError):
            if signal.getsignal(sig) is _stop_then_die:
                signal.signal(sig, signal.SIG_DFL)


_fork = threading.local()  # the signal mask before the fork, in the forking thread


def _before_fork() -> None:
    ours = [sig for sig in _SIGNALS if signal.getsignal(sig) is _stop_then_die]
    _fork.mask = signal.pthread_sigmask(signal.SIG_BLOCK, ours) if ours else None


def _after_fork_in_parent() -> None:
    mask, _fork.mask = getattr(_fork, "mask", None), None
    if mask is not None:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def _after_fork_in_child() -> None:
    mask, _fork.mask = getattr(_fork, "mask", None), None
    if mask is not None:
        for sig in _SIGNALS:  # the child has no server of its own (yet)
            with contextlib.suppress(ValueError, OSError):
                if signal.getsignal(sig) is _stop_then_die:
                    signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)  # a signal sent meanwhile now kills


if hasattr(os, "register_at_fork") and hasattr(signal, "pthread_sigmask"):
    os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent,
                        after_in_child=_after_fork_in_child)


def pdeathsig_preexec() -> Callable[[], None] | None:
    """preexec_fn making Linux SIGKILL the child when the parent dies."""
    if not sys.platform.startswith("linux"):
        return None
    if not _in_main_thread():
        return None  # PDEATHSIG fires when the forking *thread* exits: only use from main
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent, sig = os.getpid(), int(signal.SIGKILL)

    def _preexec() -> None:
        prctl(1, sig)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # parent died before prctl took effect
            os._exit(1)

    return _preexec
