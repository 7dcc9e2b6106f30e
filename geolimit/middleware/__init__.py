"""Rate-limiting middlewares: pure ASGI (Starlette, FastAPI, ...) and aiohttp.

Both use the shared HTTP layer (:mod:`geolimit.http`): the same key extractors,
costs, trusted-proxy handling, shadow limits, failure policies and headers as
the reverse proxy. Neither needs Starlette or FastAPI installed.
"""

from geolimit.middleware.aiohttp import geolimit_middleware, on_response_prepare, setup_geolimit
from geolimit.middleware.asgi import GeolimitMiddleware
from geolimit.middleware.common import ThreadedDecider, policy
from geolimit.middleware.rules import check_agent_routes

__all__ = [
    "GeolimitMiddleware",
    "ThreadedDecider",
    "check_agent_routes",
    "geolimit_middleware",
    "on_response_prepare",
    "policy",
    "setup_geolimit",
]
