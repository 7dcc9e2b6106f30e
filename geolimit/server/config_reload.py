"""What a reload (SIGHUP, :meth:`Agent.reload <geolimit.server.agent.Agent.reload>`) takes of a
re-read agent configuration: its rules and settings, except those that need a restart."""

from __future__ import annotations

from dataclasses import replace

from geolimit.server.config import AgentConfig

__all__ = ["applied_on_reload", "needs_restart", "rule_changes"]


def needs_restart(old: AgentConfig, new: AgentConfig) -> list[str]:
    """The changed settings a reload reports but does not apply (listen addresses, peers, secret, ...)."""
    return [
        name for name, a, b in (
            ("listen", old.listen, new.listen), ("api_listen", old.api_listen, new.api_listen),
            ("peers", old.peers, new.peers), ("secret", old.secret, new.secret),
            ("redis_url", old.redis_url, new.redis_url), ("gossip interval", old.interval, new.interval),
            ("rls_listen", old.rls_listen, new.rls_listen),
            ("rls_fast_path", old.rls_fast_path, new.rls_fast_path),
        ) if a != b
    ]


def rule_changes(old: AgentConfig, new: AgentConfig) -> str:
    """The rules added, removed and changed, as ``"+added -removed ~changed"`` (empty: none)."""
    before = {r.name: r for r in old.rules}
    after = {r.name: r for r in new.rules}
    summary = [f"+{n}" for n in after if n not in before] + [f"-{n}" for n in before if n not in after]
    summary += [f"~{n}" for n in after if n in before and after[n] != before[n]]
    return " ".join(summary)


def applied_on_reload(old: AgentConfig, new: AgentConfig) -> AgentConfig:
    """``new`` with the settings that need a restart (and ``workers``) kept as ``old`` has them."""
    return replace(new, listen=old.listen, api_listen=old.api_listen, peers=old.peers,
                   secret=old.secret, redis_url=old.redis_url, interval=old.interval,
                   workers=old.workers, rls_listen=old.rls_listen,
                   rls_fast_path=old.rls_fast_path)
