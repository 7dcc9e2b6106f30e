"""Envoy's rate limit service (RLS v3) in the agent.

* :mod:`~geolimit.server.rls.descriptors`: envoyproxy/ratelimit's YAML shape, parsed and matched (no I/O);
* :mod:`~geolimit.server.rls.decide`: requests planned into script calls and answered (no I/O);
* :mod:`~geolimit.server.rls.script`: the all-or-nothing script built on ``hit.lua``;
* :mod:`~geolimit.server.rls.loading`: reading the YAML files;
* :mod:`~geolimit.server.rls.executor` and :mod:`~geolimit.server.rls.server`: Redis calls and the gRPC listener;
* :mod:`~geolimit.server.rls.h2c` (with ``h2conn``, ``h2send``, ``h2control``, ``h2wire``): one unary gRPC
  method over HTTP/2 cleartext on asyncio Protocols, the default transport (``[region] rls_fast_path``);
* :mod:`~geolimit.server.rls.transport`: the same served from grpcio's core into the event loop.

Only the last four need the ``rls`` extra (grpcio, xds-protos, hpack); the agent imports
them when ``[region] rls_listen`` is set.
"""
