"""`geolimit try`'s answers a newcomer meets first: no Redis at --redis, a cost above the limit.

Once, `geolimit try 5/10s user:42` with no Redis said only `Redis unreachable: ... Connection
refused.`, and `geolimit try --embedded --cost 6 5/10s u` printed `retry_after=infs` (where
`geolimit check` prints `never`) without saying why nothing could pass.
"""

from __future__ import annotations

import socket

from tests.support.cli_usage import run_cli


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_try_without_a_redis_says_how_to_get_one() -> None:
    url = f"redis://127.0.0.1:{_closed_port()}/0"
    out = run_cli("try", "--redis", url, "5/10s", "user:42")
    assert out.returncode == 1, out
    assert out.stdout == ""
    assert "Traceback" not in out.stderr
    first, hint = out.stderr.splitlines()
    assert first.startswith("geolimit: error: Redis unreachable: "), first
    assert "Connection refused" in first
    assert hint == ("  no Redis answers there: add --embedded for a throwaway redis-server, or start one with "
                    "`geolimit redis` (it prints its URL) and pass that URL with --redis URL")
    help_text = run_cli("try", "--help").stdout
    assert "--embedded" in help_text
    assert "--redis REDIS" in help_text, "the hint names the real flags"


def test_try_with_a_cost_above_the_limit_says_never_and_why() -> None:
    out = run_cli("try", "--embedded", "--times", "2", "--cost", "6", "5/10s;100/1h", "u")
    assert out.returncode == 0, out
    lines = out.stdout.splitlines()
    assert lines[0].startswith("embedded redis-server at redis://127.0.0.1:"), lines
    assert [line.split()[:2] for line in lines[1:3]] == [["denied", "try.10s"]] * 2
    assert all(" retry_after=never " in line for line in lines[1:3]), lines
    assert "inf" not in out.stdout
    assert lines[3:] == ["note: the cost 6 exceeds the limit of rule 'try.10s' (5 per 10s): a hit of this cost "
                         "is never allowed (retry_after=never)"]


def test_try_within_the_limit_adds_no_note() -> None:
    out = run_cli("try", "--embedded", "--times", "2", "--cost", "5", "5/10s", "u")
    assert out.returncode == 0, out
    lines = out.stdout.splitlines()[1:]
    assert [line.split()[0] for line in lines] == ["allowed", "denied"], lines
    assert "retry_after=never" not in out.stdout
    assert "note:" not in out.stdout
