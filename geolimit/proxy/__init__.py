"""A rate-limiting HTTP reverse proxy on aiohttp: ``geolimit proxy --config proxy.toml``.

Requests are matched against the ``[[route]]`` tables (first match wins); the
route's limits are decided with the region's global view (library mode: one Lua
call per limit in the region's Redis; agent mode: ``POST /v1/check`` to the
region's agent, whose rules the routes are checked against at start:
geolimit/proxy/agent_rules.py), and the request goes to an upstream only if every
enforced limit allows it. Unmatched paths and routes without limits are forwarded
unlimited. The file format is in :mod:`geolimit.proxy.config`.

Behaviour:

* **Denials**: 429 with ``Retry-After`` (none when the request can never pass: its
  cost is above a limit), ``RateLimit-Policy`` and ``RateLimit``
  (IETF httpapi ratelimit-headers, Structured Fields), optionally
  ``X-RateLimit-*``, and an ``application/problem+json`` body. Allowed responses
  carry the same informational headers. A shadow limit counts, logs and reports
  in metrics but never denies. When Redis or the agent cannot decide, each limit
  fails open (``on_error = "allow"``, default) or closed (``"deny"``: 503
  problem+json with ``Retry-After: 1``), with a metric and a log line.
* **Errors** are problem+json: 400 unreadable cost header (nothing is consumed),
  413 body over ``max_body``, 502 upstream unreachable or broken, 504 upstream
  timeout (an admitted request's 413, 502 and 504 keep its ``RateLimit`` fields:
  it consumed quota). An upstream failure after the response started aborts the client's
  connection. A client that goes away cancels its upstream exchange. Every upstream
  failure counts in ``geolimit_proxy_upstream_errors_total{upstream,kind}``; the log
  gets at most one line per 10 s per upstream and kind, counting the others
  (geolimit/proxy/failures.py).
* **Streaming**: bodies stream both ways with bounded buffers (any size; only
  request and response bodies of at most 64 KiB with a known length are read
  whole). ``Expect:
  100-continue`` is answered after the decision, so a denied upload is never sent.
* **Upstreams**: round robin; a connect failure moves an idempotent request
  without a streamed body to the next upstream (each is tried once); other
  requests get 502. Keep-alive connections are pooled; cookies are never kept.
* **Headers**: hop-by-hop headers are dropped both ways; ``Host`` is the
  upstream's (``preserve_host`` keeps the client's); ``X-Forwarded-For``,
  ``-Proto``, ``-Host`` and ``Forwarded`` are extended when the peer is a trusted
  proxy and replaced otherwise, and only trusted peers' headers choose the client
  address used in ``ip`` keys.
* **Admin listener** (``admin_listen``): ``/metrics``, ``/healthz``, ``/readyz``;
  the proxied listener serves no path of its own.
* **Signals**: SIGTERM/SIGINT stop accepting and give in-flight requests
  ``shutdown_timeout`` seconds, then exit 0; SIGHUP reloads routes, rules,
  upstreams and options after validating the file (a bad file is logged and the
  running configuration stays).

* **Fast path** (``fast_path = true``, the default, with ``http://`` upstreams):
  the listener is served by asyncio Protocols (geolimit/proxy/fast_server.py)
  with a keep-alive pool of upstream connections, and aiohttp stays out of the
  data path for the common requests (HTTP/1.1, origin-form, printable ASCII
  heads, no body or a ``Content-Length`` body of at most 64 KiB). Any other
  request hands its connection to aiohttp's server, which serves it as above;
  the answers are the same either way. A request head (and such a small body)
  must arrive within 30 s of its first byte, else 408 and the connection closes.

Limitations: no WebSocket/``Upgrade`` pass-through, no HTTP/2, no TLS on the
listener (terminate TLS in front), and header bytes that are not UTF-8 lose
their undecodable bytes on the way upstream (aiohttp's client encodes header
values as UTF-8); the limit key still uses the raw bytes.
"""

from geolimit.proxy.config import ProxyConfig, load_proxy_config, parse_proxy_config
from geolimit.proxy.run import run_proxy
from geolimit.proxy.server import Proxy

__all__ = ["Proxy", "ProxyConfig", "load_proxy_config", "parse_proxy_config", "run_proxy"]
