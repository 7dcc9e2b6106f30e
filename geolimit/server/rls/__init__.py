"""Envoy's rate limit service (RLS v3) in the agent.

* :mod:`~geolimit.server.rls.descriptors`: envoyproxy/ratelimit's YAML shape, parsed and matched (no I/O);
* :mod:`~geolimit.server.rls.decide`: requests planned into script calls and answered (no I/O);
* :mod:`~geolimit.server.rls.script`: the all-or-nothing script built on ``hit.lua``;
* :mod:`~geolimit.server.rls.loading`: reading the YAML files;
* :mod:`~geolimit.server.rls.executor` and :mod:`~geolimit.server.rls.server`: Redis calls and the gRPC listener;
* :mod:`~geolimit.server.rls.transport`: one unary gRPC method served from grpcio's core into the event loop.

Only the last three need the ``rls`` extra's grpcio and xds-protos; the agent imports
them when ``[region] rls_listen`` is set.
"""
