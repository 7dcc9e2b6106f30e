"""geolimit: a multi-region rate limiter on Redis.

Each region decides locally, in one atomic Lua call against its own Redis;
counts are clock-aligned hash buckets holding CRDT G-counter slots, which a
replication agent merges between regions.
"""

from geolimit.async_limiter import AsyncLimiter
from geolimit.core.clock import ManualClock
from geolimit.core.decision import Decision, RuleDecision
from geolimit.core.keys import KeyLayout
from geolimit.core.rule import Rule, parse_rate
from geolimit.core.usage import Usage
from geolimit.decorators import alimit, limit, limited
from geolimit.errors import (
    AuthenticationError,
    ConfigError,
    GeolimitError,
    ProtocolError,
    RateLimited,
    RequestError,
    StorageError,
    UnknownRuleError,
)
from geolimit.limiter import Limiter

__all__ = [
    "AsyncLimiter",
    "AuthenticationError",
    "ConfigError",
    "Decision",
    "GeolimitError",
    "KeyLayout",
    "Limiter",
    "ManualClock",
    "ProtocolError",
    "RateLimited",
    "RequestError",
    "Rule",
    "RuleDecision",
    "StorageError",
    "UnknownRuleError",
    "Usage",
    "alimit",
    "limit",
    "limited",
    "parse_rate",
]
__version__ = "0.1.0"
