"""Children that a Ctrl-C reaches, however the test run itself was started."""

from __future__ import annotations

import signal


def default_sigint() -> None:
    """``preexec_fn`` for a child sent SIGINT by a test: a run started as a background job
    of a non-interactive shell ignores SIGINT, children inherit that, and Python (or bash)
    then never sees the Ctrl-C. The child starts with the default disposition instead."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
