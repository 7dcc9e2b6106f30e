"""What the agent's HTTP route modules use of the agent (:class:`~geolimit.server.agent.Agent` has it all).

``api.py`` (the decision API and health routes) and ``gossip_http.py`` (``POST
/v1/gossip``) take these narrow views instead of the ``Agent`` class, so they do
not import it (``agent.py`` imports them to build its application).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from geolimit.async_limiter import AsyncLimiter
    from geolimit.replication.auth import Signer, Verifier
    from geolimit.replication.gossip import GossipEngine
    from geolimit.server.admission import CheckGate
    from geolimit.server.metrics import AgentMetrics

__all__ = ["ApiAgent", "ApiSettings", "GossipAgent", "GossipSettings"]


class ApiSettings(Protocol):
    @property
    def api_token(self) -> str | None:
        """The bearer token the decision API requires (None: open)."""

    @property
    def rule_groups(self) -> Mapping[str, tuple[str, ...]]:
        """Multi-rate ``[[rule]]`` tables: the table's name -> its rules' names."""


class ApiAgent(Protocol):
    """The decision API (``/v1/check`` ...) and the health routes (``/healthz``, ``/readyz``, ``/metrics``)."""

    @property
    def config(self) -> ApiSettings: ...

    @property
    def metrics(self) -> AgentMetrics: ...

    @property
    def checks(self) -> CheckGate:
        """The bound on decisions in progress (``region.max_checks_in_progress``)."""

    def require_limiter(self) -> AsyncLimiter:
        """The running limiter (a StorageError while the agent starts)."""

    def status(self) -> dict[str, Any]:
        """The ``/v1/status`` body."""

    def failure(self) -> str | None:
        """Why the agent is not alive (None: it is)."""

    def readiness(self) -> tuple[bool, list[str]]:
        """Whether the agent is ready, and what it waits for."""


class GossipSettings(Protocol):
    @property
    def max_message_bytes(self) -> int:
        """The largest gossip body accepted."""

    @property
    def timeout(self) -> float:
        """Seconds a gossip exchange may take (a sender gives up after it)."""


class GossipAgent(Protocol):
    """``POST /v1/gossip``: authenticate, merge through the engine, sign the reply."""

    @property
    def config(self) -> GossipSettings: ...

    @property
    def metrics(self) -> AgentMetrics: ...

    @property
    def verifier(self) -> Verifier: ...

    @property
    def signer(self) -> Signer: ...

    @property
    def engine(self) -> GossipEngine | None:
        """None until the agent has started."""
