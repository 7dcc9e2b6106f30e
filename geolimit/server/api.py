"""The agent's JSON API for apps.

``POST /v1/check`` (and ``/v1/peek``, ``/v1/reset``) take::

    {"rule": "api", "subject": "user:42", "cost": 1}
    {"rules": ["burst", "hourly"], "subject": "ip:1.2.3.4"}        # all-or-nothing
    [{"rule": "api", "subject": "a"}, {"rule": "api", "subject": "b"}]   # batch
    {"checks": [ ... ]}                                             # batch, too

``subject_b64`` may replace ``subject`` for binary subjects. A rule name may be
that of a ``[[rule]]`` table whose limit holds several rates (``api`` for
``"10/hour;5/minute"``): it stands for all of its rules (``api.1h``, ``api.1m``),
decided all-or-nothing, and the answer lists each. A bad body gets 400
with ``{"error": ..., "field": ...}``; an unknown rule gets 404 and a body over
1 MiB gets 413. Every check of a request is validated (unknown rules included)
before any of them runs, so a refused batch consumes nothing.

A decision (one check, not a batch) is answered 200, allowed or not, with the
IETF ``RateLimit-Policy`` and ``RateLimit`` fields that the proxy and the
middlewares send (geolimit/http/headers.py; quotas in the rules' own units), and
``Retry-After`` when it is denied and waiting helps (never when the cost is above
a limit): an app can copy them to its own answer.

When the config has an API token (``region.api_token_file``), the ``/v1/check``,
``/v1/peek``, ``/v1/reset``, ``/v1/usage`` and ``/v1/status`` endpoints require
``Authorization: Bearer <token>`` and answer 401 otherwise. ``/healthz``,
``/readyz`` and ``/metrics`` stay open; ``/v1/gossip`` has its own HMAC auth.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hmac
import logging
import time
import urllib.parse
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from aiohttp import web

from geolimit.core.decision import Decision
from geolimit.core.keys import MAX_SUBJECT_BYTES
from geolimit.errors import BadRequest, GeolimitError, RequestError, StorageError, UnknownRuleError
from geolimit.http.headers import QuotaUnit, rate_limit_headers
from geolimit.replication.refusals import RefusalLog
from geolimit.server.api_body import MAX_BODY, _ClientGone, body_guard, read_json_body
from geolimit.server.metrics import CONTENT_TYPE as METRICS_TYPE
from geolimit.server.routes_protocol import ApiAgent
from geolimit.store.protocol import MAX_COST

if TYPE_CHECKING:
    from multidict import MultiMapping

    from geolimit.async_limiter import AsyncLimiter

__all__ = ["MAX_BATCH", "MAX_BODY", "BadRequest", "Check", "add_api_routes", "add_health_routes", "parse_check"]

log = logging.getLogger("geolimit.agent")

_refusals = RefusalLog(log)
MAX_BATCH = 1000
_FIELDS = frozenset({"rule", "rules", "subject", "subject_b64", "cost"})
_USAGE_PARAMS = frozenset({"rule", "subject", "subject_b64"})

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass(frozen=True)
class Check:
    """One validated check: rule name(s), subject bytes, cost, and where it sat in the body."""

    rules: str | list[str]
    subject: bytes
    cost: int
    where: str = ""

    @property
    def names(self) -> tuple[str, ...]:
        return (self.rules,) if isinstance(self.rules, str) else tuple(self.rules)

    @property
    def rule_field(self) -> str:
        return self.where + ("rule" if isinstance(self.rules, str) else "rules")


def _fail(exc: BadRequest) -> web.Response:
    body: dict[str, Any] = {"error": str(exc)}
    if exc.field:
        body["field"] = exc.field
    headers = {"WWW-Authenticate": 'Bearer realm="geolimit"'} if exc.status == 401 else None
    return web.json_response(body, status=exc.status, headers=headers)


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


def parse_check(item: object, where: str = "") -> Check:
    """Validate one check object; :class:`BadRequest` names the offending field."""
    if not isinstance(item, dict):
        raise BadRequest(f"{where.rstrip('.') or 'body'} must be a JSON object", where.rstrip(".") or "body")
    for key in item:
        if key not in _FIELDS:
            raise BadRequest(f"unknown field {_shown(key)}; allowed: {', '.join(sorted(_FIELDS))}", where + key[:100])
    rules: str | list[str]
    if "rule" in item and "rules" in item:
        raise BadRequest("give either 'rule' (a name) or 'rules' (a list of names), not both", where + "rules")
    if "rule" in item:
        rule = item["rule"]
        if not isinstance(rule, str) or not rule:
            raise BadRequest("'rule' must be a non-empty string", where + "rule")
        rules = rule
    elif "rules" in item:
        names = item["rules"]
        if not isinstance(names, list) or not names or not all(isinstance(n, str) and n for n in names):
            raise BadRequest("'rules' must be a non-empty list of rule names", where + "rules")
        if len(set(names)) != len(names):
            raise BadRequest("'rules' names a rule twice", where + "rules")
        rules = list(names)
    else:
        raise BadRequest("missing 'rule' (a name) or 'rules' (a list of names)", where + "rule")
    if "subject" in item and "subject_b64" in item:
        raise BadRequest("give either 'subject' or 'subject_b64', not both", where + "subject_b64")
    if "subject" in item:
        if not isinstance(item["subject"], str):
            raise BadRequest("'subject' must be a string (use 'subject_b64' for bytes)", where + "subject")
        subject = item["subject"].encode("utf-8", "surrogatepass")
        subject_field = where + "subject"
    elif "subject_b64" in item:
        raw = item["subject_b64"]
        subject_field = where + "subject_b64"
        if not isinstance(raw, str):
            raise BadRequest("'subject_b64' must be a base64 string", subject_field)
        try:
            subject = base64.b64decode(raw.encode("ascii"), validate=True)
        except (binascii.Error, ValueError):
            raise BadRequest("'subject_b64' is not valid base64", subject_field) from None
    else:
        raise BadRequest("missing 'subject' (or 'subject_b64')", where + "subject")
    if len(subject) > MAX_SUBJECT_BYTES:
        raise BadRequest(
            f"the subject is {len(subject)} bytes; the maximum is {MAX_SUBJECT_BYTES}", subject_field
        )
    cost = item.get("cost", 1)
    if isinstance(cost, bool) or not isinstance(cost, int) or not 0 <= cost <= MAX_COST:
        raise BadRequest(f"'cost' must be an integer from 0 to 2**46 ({MAX_COST})", where + "cost")
    return Check(rules, subject, cost, where)


def _checks(body: object) -> tuple[list[Check], bool]:
    """The checks of a body and whether it was a batch."""
    if isinstance(body, dict) and "checks" in body:
        extra = sorted(set(body) - {"checks"})
        if extra:
            raise BadRequest(f"a batch object holds only 'checks', not {_shown(extra[0])}", extra[0][:100])
        body = body["checks"]
        if not isinstance(body, list):
            raise BadRequest("'checks' must be a list", "checks")
    if isinstance(body, list):
        if not body or len(body) > MAX_BATCH:
            raise BadRequest(f"a batch holds 1 to {MAX_BATCH} checks, got {len(body)}", "checks")
        return [parse_check(item, f"checks[{i}].") for i, item in enumerate(body)], True
    return [parse_check(body)], False


def _resolved(limiter: AsyncLimiter, groups: Mapping[str, tuple[str, ...]], checks: Sequence[Check]) -> list[Check]:
    """The checks with the name of a multi-rate ``[[rule]]`` table (``api`` for ``"10/hour;5/minute"``)
    replaced by its rules (``api.1h``, ``api.1m``: all-or-nothing, as one list); 404 for the first
    unknown name, before anything is consumed."""
    out: list[Check] = []
    for check in checks:
        names: list[str] = []
        for name in check.names:
            members: tuple[str, ...] = (name,)
            try:
                limiter.rule(name)
            except UnknownRuleError:
                members = tuple(groups.get(name, ()))
                if not members:
                    raise BadRequest(_unknown_rule(name, limiter, groups), check.rule_field, status=404) from None
                for member in members:  # a reload in between: the table's rules must all be there
                    try:
                        limiter.rule(member)
                    except UnknownRuleError as gone:
                        raise BadRequest(str(gone), check.rule_field, status=404) from None
            for member in members:
                if member in names:
                    raise BadRequest(f"rule {_shown(member)} is named twice (directly or by its [[rule]] table)",
                                     check.rule_field)
                names.append(member)
        out.append(check if list(check.names) == names else replace(check, rules=names))
    return out


def _shown(value: str) -> str:
    """``repr(value)``, cut to 100 characters: error answers never echo a client's megabytes."""
    return repr(value) if len(value) <= 100 else repr(value[:100]) + f"... ({len(value)} characters)"


def _unknown_rule(name: str, limiter: AsyncLimiter, groups: Mapping[str, tuple[str, ...]]) -> str:
    """The 404 message for ``name``: the names a request may use, a multi-rate table's with its
    rules (``api, multi (multi.1h, multi.1m)``)."""
    rules = limiter.rules
    tables = {table: members for table, members in groups.items() if all(m in rules for m in members)}
    grouped = {member for members in tables.values() for member in members}
    known = [rule for rule in rules if rule not in grouped]
    known += [f"{table} ({', '.join(members)})" for table, members in tables.items()]
    return f"unknown rule {_shown(name)}; known rules: {', '.join(sorted(known))}" if known else f"unknown rule {_shown(name)}"


def _fields(decision: Decision, cost: int) -> list[tuple[str, str]]:
    """``RateLimit-Policy`` and ``RateLimit`` of a decision (and ``Retry-After`` when it denies and waiting
    helps), as the proxy and the middlewares send them; quotas count the rules' own units."""
    return rate_limit_headers(decision, units=(QuotaUnit.of(cost, fixed=False),) * len(decision.results))


def _authorized(request: web.Request, token: bytes) -> bool:
    scheme, _, value = request.headers.get("Authorization", "").strip().partition(" ")
    if scheme.lower() != "bearer":
        return False
    given = value.strip().encode("utf-8", "surrogateescape")
    return hmac.compare_digest(given, token)


def _guarded(handler: Handler, token: str | None) -> Handler:
    """Bearer-token check (when configured) and a JSON 500 for anything unexpected."""
    secret = token.encode() if token else None

    async def wrapped(request: web.Request) -> web.StreamResponse:
        if secret is not None and not _authorized(request, secret):
            return _fail(BadRequest("missing or wrong API token: send 'Authorization: Bearer <token>'",
                                    "Authorization", status=401))
        try:
            return await handler(request)
        except BadRequest as exc:
            return _fail(exc)
        except _ClientGone:  # logged once per period by the body guard; nobody reads an answer
            return _error(400, "connection lost mid-body")
        except StorageError as exc:
            return _error(503, str(exc))
        except RequestError as exc:
            return _error(400, str(exc))
        except GeolimitError as exc:
            log.error("%s %s failed: %s", request.method, request.path, exc)
            return _error(500, str(exc))
        except web.HTTPException:
            raise
        except Exception as exc:
            log.exception("%s %s crashed", request.method, request.path)
            return _error(500, f"internal error: {type(exc).__name__}")

    return wrapped


def _usage_check(query: MultiMapping[str], raw_query: str = "") -> Check:
    """The check of a ``GET /v1/usage`` query string (one rule, one subject). ``raw_query``: the
    string as sent, whose percent-escapes must decode to UTF-8 (aiohttp would turn ``%ff`` into
    U+FFFD, another subject)."""
    try:
        urllib.parse.parse_qsl(raw_query, keep_blank_values=True, errors="strict")
    except UnicodeDecodeError:
        raise BadRequest("the query string is not UTF-8 once percent-decoded: give a subject that is not UTF-8 "
                         "as subject_b64 (base64)", "subject") from None
    for key in query:
        if key not in _USAGE_PARAMS:
            raise BadRequest(f"unknown query parameter {_shown(key)}; allowed: rule, subject, subject_b64", key[:100])
        if len(query.getall(key)) > 1:
            raise BadRequest(f"query parameter {_shown(key)} is given twice", key[:100])
    if not query.get("rule"):
        raise BadRequest("query parameter 'rule' is required", "rule")
    return parse_check(dict(query))


class _ApiHandlers:
    """The handlers of the decision API, on one agent."""

    def __init__(self, agent: ApiAgent) -> None:
        self.agent = agent
        self._bodies = body_guard(_refusals)

    async def check(self, request: web.Request) -> web.Response:
        return await self._decide(request, consume=True)

    async def peek(self, request: web.Request) -> web.Response:
        return await self._decide(request, consume=False)

    async def _decide(self, request: web.Request, consume: bool) -> web.Response:
        gate = self.agent.checks
        if gate.full():  # overloaded: answered before its body is read (geolimit/server/admission.py)
            gate.refuse()
            return gate.overloaded()
        checks, batch = _checks(await read_json_body(request, self._bodies))
        if not gate.enter(len(checks)):
            return gate.overloaded()
        try:
            return await self._decide_checks(checks, batch, consume)
        finally:
            gate.leave(len(checks))

    async def _decide_checks(self, checks: list[Check], batch: bool, consume: bool) -> web.Response:
        limiter = self.agent.require_limiter()
        checks = _resolved(limiter, self.agent.config.rule_groups, checks)
        started = time.perf_counter()
        try:
            if consume:
                decisions = await limiter.hit_many([(c.rules, c.subject, c.cost) for c in checks])
            else:
                decisions = list(await asyncio.gather(*(limiter.peek(c.rules, c.subject, c.cost) for c in checks)))
        except UnknownRuleError as exc:  # a concurrent rule reload
            raise BadRequest(str(exc), "rule", status=404) from None
        self._observe(decisions, time.perf_counter() - started)
        out = [d.as_dict() for d in decisions]
        if batch:  # decisions for several subjects: the fields of each are in its result
            return web.json_response({"results": out})
        return web.json_response(out[0], headers=_fields(decisions[0], checks[0].cost))

    def _observe(self, decisions: list[Decision], elapsed: float) -> None:
        metrics = self.agent.metrics
        share = elapsed / len(decisions)
        for d in decisions:
            metrics.decisions.labels(d.rule, "allowed" if d.allowed else "denied").inc()
            metrics.decision_seconds.observe(share)

    async def reset(self, request: web.Request) -> web.Response:
        checks, _ = _checks(await read_json_body(request, self._bodies))
        limiter = self.agent.require_limiter()
        checks = _resolved(limiter, self.agent.config.rule_groups, checks)
        for c in checks:  # a batch with a refused item resets nothing
            limiter.reset_rules(c.rules)
        for c in checks:
            await limiter.reset(c.rules, c.subject)
        return web.json_response({"reset": len(checks)})

    async def usage(self, request: web.Request) -> web.Response:
        parsed = _usage_check(request.query, request.rel_url.raw_query_string)
        limiter = self.agent.require_limiter()
        parsed = _resolved(limiter, self.agent.config.rule_groups, [parsed])[0]
        if not isinstance(parsed.rules, str):
            raise BadRequest(f"rule {request.query['rule']!r} stands for the rules {', '.join(parsed.rules)}: "
                             "ask for one of them", "rule")
        result = await limiter.usage(parsed.rules, parsed.subject)
        return web.json_response(result.as_dict())

    async def status(self, request: web.Request) -> web.Response:
        return web.json_response(self.agent.status())


def add_api_routes(app: web.Application, agent: ApiAgent) -> None:
    """``/v1/check``, ``/v1/peek``, ``/v1/reset``, ``/v1/usage`` and ``/v1/status``, behind the API token if any."""
    handlers = _ApiHandlers(agent)
    token = agent.config.api_token
    app.router.add_post("/v1/check", _guarded(handlers.check, token))
    app.router.add_post("/v1/peek", _guarded(handlers.peek, token))
    app.router.add_post("/v1/reset", _guarded(handlers.reset, token))
    app.router.add_get("/v1/usage", _guarded(handlers.usage, token))
    app.router.add_get("/v1/status", _guarded(handlers.status, token))


def add_health_routes(app: web.Application, agent: ApiAgent) -> None:
    async def healthz(request: web.Request) -> web.Response:
        problem = agent.failure()
        if problem:
            return web.json_response({"alive": False, "error": problem}, status=500)
        return web.json_response({"alive": True})

    async def readyz(request: web.Request) -> web.Response:
        ready, reasons = agent.readiness()
        return web.json_response({"ready": ready, "waiting_for": reasons}, status=200 if ready else 503)

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(body=agent.metrics.render(), headers={"Content-Type": METRICS_TYPE})

    app.router.add_get("/healthz", _guarded(healthz, None))
    app.router.add_get("/readyz", _guarded(readyz, None))
    app.router.add_get("/metrics", _guarded(metrics, None))
