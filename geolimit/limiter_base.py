"""What :class:`~geolimit.Limiter` and :class:`~geolimit.AsyncLimiter` share:
rule lookup, argument validation, request building, degraded decisions and the
rule-structure check against Redis. No I/O happens here."""

from __future__ import annotations

import logging
import re
import secrets
import time
from collections.abc import Iterable, Sequence
from typing import Literal

from geolimit.core.clock import Clock, micros_source
from geolimit.core.decision import Decision, degraded_decision
from geolimit.core.keys import MAX_SUBJECT_BYTES, KeyLayout, encode_subject
from geolimit.core.rule import Rule
from geolimit.core.usage import Usage, summarize, summarize_escrow
from geolimit.errors import ConfigError, RequestError, StorageError, UnknownRuleError
from geolimit.log_every import LogEvery
from geolimit.store.escrow_fields import ledger_of, state_of
from geolimit.store.protocol import (
    MAX_COST,
    EscrowPlacement,
    HitRequest,
    RequestBuilder,
    RulePlan,
    validate_cost,
)

__all__ = ["ESCROW_FIELD", "LimiterBase", "OnError", "RuleSpec", "parse_escrow_field", "rule_spec", "validate_region"]

OnError = Literal["raise", "allow", "deny"]
RuleSpec = str | Rule | Sequence[str | Rule]

log = logging.getLogger("geolimit")

_REGION_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
#: How often a long-lived limiter re-checks its rules against Redis.
RULE_CHECK_INTERVAL = 60.0
# Field of the rules hash naming the region that owns this Redis and prefix; "@" is
# not allowed in rule names, so it cannot collide with one.
REGION_FIELD = "@region"
#: Field of the rules hash where the agent publishes the regions of escrow mode:
#: ``"<region>,<region>,...;<wait_us>"`` (sorted names; how soon a peer's rights arrive).
ESCROW_FIELD = "@escrow"
#: How often a limiter with escrow rules looks for the regions while it does not know them.
ESCROW_LOOKUP_INTERVAL = 1.0


def rule_spec(rule: Rule) -> bytes:
    """A rule's structure as kept in the rules hash: ``window_us/resolution_us`` (``/escrow`` added)."""
    window_us, resolution_us, escrow = rule.structure
    return b"%d/%d%s" % (window_us, resolution_us, b"/escrow" if escrow else b"")


def _describe_spec(spec: bytes) -> str:
    parts = spec.split(b"/")
    try:
        text = f"window {int(parts[0]) / 1e6:g}s and resolution {int(parts[1]) / 1e6:g}s"
    except (ValueError, IndexError):
        return repr(spec)
    return text + (" in escrow mode" if parts[2:] == [b"escrow"] else "")


def parse_escrow_field(raw: bytes | str | None) -> tuple[tuple[str, ...], int] | None:
    """``(sorted regions, wait_us)`` from the agent's :data:`ESCROW_FIELD`, or None if absent or malformed."""
    if raw is None:
        return None
    text = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
    names, _, wait = text.partition(";")
    regions = tuple(sorted(n for n in names.split(",") if n))
    if not regions or not wait.isdigit() or any(not _REGION_RE.match(n) for n in regions):
        return None
    return regions, int(wait)


def validate_region(region: object) -> str:
    if not isinstance(region, str) or not _REGION_RE.match(region):
        raise ConfigError(f"invalid region name {region!r}: use 1-64 characters from A-Z a-z 0-9 _ . -")
    return region


class LimiterBase:
    """Shared state of the sync and async limiters."""

    def __init__(
        self,
        *,
        region: str,
        rules: Iterable[Rule],
        layout: KeyLayout | None = None,
        on_error: OnError = "raise",
        clock: Clock | None = None,
    ) -> None:
        self._region = validate_region(region)
        self._region_b = region.encode()
        self._nonce = secrets.token_hex(3).encode()
        self._layout = layout or KeyLayout()
        if on_error not in ("raise", "allow", "deny"):
            raise ConfigError(f"on_error must be 'raise', 'allow' or 'deny', got {on_error!r}")
        self._on_error: OnError = on_error
        self._micros = micros_source(clock)
        self._rules: dict[str, Rule] = {}
        self._plans: dict[str, RulePlan] = {}
        self._escrow: EscrowPlacement | None = None
        self._builder = RequestBuilder(self._layout)
        self._check_due = 0.0
        self.degraded_lines = LogEvery(log)  # one line per 10 s, counting the calls held back
        self.set_rules(rules)

    @property
    def region(self) -> str:
        return self._region

    @property
    def layout(self) -> KeyLayout:
        return self._layout

    @property
    def rules(self) -> dict[str, Rule]:
        """The configured rules by name (a copy)."""
        return dict(self._rules)

    def set_rules(self, rules: Iterable[Rule]) -> None:
        """Replace the rule set (for example on a config reload)."""
        new: dict[str, Rule] = {}
        for rule in rules:
            if not isinstance(rule, Rule):
                raise ConfigError(f"rules must be Rule objects, got {rule!r}")
            if rule.name in new:
                raise ConfigError(f"duplicate rule name {rule.name!r}")
            new[rule.name] = rule
        self._rules = new
        self._plans = {name: RulePlan.of(rule, self._escrow) for name, rule in new.items()}
        self._check_due = 0.0

    @property
    def escrow_regions(self) -> tuple[str, ...] | None:
        """The regions of escrow mode as the agent published them (None: not known yet)."""
        return None if self._escrow is None else self._escrow.regions

    def use_escrow_regions(self, regions: Iterable[str], wait_us: int) -> None:
        """Take the regions of escrow mode directly (the agent's own limiter does)."""
        self._apply_escrow_field(",".join(sorted(regions)) + f";{wait_us}")

    def _summarize(
        self, rule: Rule, subject: bytes, registry: dict[bytes, bytes], fields: dict[bytes, bytes], now_us: int,
    ) -> Usage:
        """A key's usage: the global count by region, or for an escrow rule this region's view."""
        if rule.escrow:
            used = ledger_of(fields, rule).used(now_us)
            return summarize_escrow(rule, subject, used, state_of(fields), now_us, self._region, self.escrow_regions)
        return summarize(rule, subject, registry, fields, now_us)

    def _has_escrow(self) -> bool:
        return any(rule.escrow for rule in self._rules.values())

    def _apply_escrow_field(self, raw: bytes | str | None) -> None:
        """Take the regions the agent published (see :data:`ESCROW_FIELD`); escrow rules are
        denied while they are unknown or do not name this region."""
        parsed = parse_escrow_field(raw)
        placement = None
        if parsed is not None and self._region in parsed[0]:
            placement = EscrowPlacement(parsed[0], self._region, parsed[1])
        elif parsed is not None:
            log.warning("geolimit: the agent's regions %s do not name this region %r: escrow rules are denied",
                        ",".join(parsed[0]), self._region)
        if placement != self._escrow:
            self._escrow = placement
            self._plans = {name: RulePlan.of(rule, placement) for name, rule in self._rules.items()}

    def rule(self, name: str) -> Rule:
        try:
            return self._rules[name]
        except KeyError:
            raise UnknownRuleError(name, tuple(self._rules)) from None

    def reset_rules(self, spec: RuleSpec) -> tuple[Rule, ...]:
        """The rules a reset applies to: escrow rules are left out (a reset would hand back
        rights that were spent); naming only escrow rules is a :class:`RequestError`."""
        chosen = self._resolve(spec)
        kept = tuple(r for r in chosen if not r.escrow)
        if not kept:
            names = ", ".join(repr(r.name) for r in chosen)
            which = f"rule {names} uses" if len(chosen) == 1 else f"rules {names} use"
            raise RequestError(f"{which} escrow mode: reset does not apply (it would hand back rights that "
                               "were spent; admissions leave with the window)")
        return kept

    def _resolve(self, spec: RuleSpec) -> tuple[Rule, ...]:
        if isinstance(spec, (str, Rule)):
            items: Sequence[str | Rule] = (spec,)
        elif isinstance(spec, Sequence) and spec:
            items = spec
        else:
            raise RequestError(f"rules must be a rule name or a non-empty list of names, got {spec!r}")
        out: list[Rule] = []
        for item in items:
            rule = item if isinstance(item, Rule) else self.rule(item) if isinstance(item, str) else None
            if rule is None:
                raise RequestError(f"a rule must be a name or a Rule, got {item!r}")
            if any(r.name == rule.name for r in out):
                raise RequestError(f"rule {rule.name!r} is named twice in one request")
            out.append(rule)
        return tuple(out)

    def _request(self, spec: RuleSpec, subject: str | bytes, cost: int, consume: bool) -> HitRequest:
        plans: tuple[RulePlan, ...]
        if type(spec) is str and spec in self._plans:
            plans = (self._plans[spec],)
        else:
            plans = tuple(self._plans.get(r.name) or RulePlan.of(r, self._escrow) for r in self._resolve(spec))
        if type(subject) is str:
            data = subject.encode("utf-8", "surrogatepass")
            if len(data) > MAX_SUBJECT_BYTES:
                data = encode_subject(data)  # raises the descriptive error
        else:
            data = encode_subject(subject)
        if type(cost) is not int or not 0 <= cost <= MAX_COST:
            validate_cost(cost)
        return self._builder.build(plans, data, cost, consume)

    def _now(self) -> int | None:
        return None if self._micros is None else self._micros()

    def _rules_check_due(self) -> bool:
        return time.monotonic() >= self._check_due

    def _rules_checked(self) -> None:
        wait = ESCROW_LOOKUP_INTERVAL if self._escrow is None and self._has_escrow() else RULE_CHECK_INTERVAL
        self._check_due = time.monotonic() + wait

    def _rule_check_plan(self) -> tuple[list[str], list[bytes], int]:
        """Fields to HSETNX into the rules hash and compare: each rule's structure,
        then this region's name under :data:`REGION_FIELD` (no rules: nothing)."""
        names = sorted(self._rules)
        specs = [rule_spec(self._rules[n]) for n in names]
        if names:
            names.append(REGION_FIELD)
            specs.append(self._region_b)
        ttl_ms = max([3_600_000, *(2 * r.ttl_ms for r in self._rules.values())])
        return names, specs, ttl_ms

    def _verify_rule_specs(self, names: list[str], mine: list[bytes], theirs: list[bytes | None]) -> None:
        """ConfigError on a window/resolution mismatch, or when ``names`` carries
        :data:`REGION_FIELD` and Redis holds another region's name there."""
        for name, want, have in zip(names, mine, theirs, strict=True):
            if name == REGION_FIELD:
                self._verify_region(have)
                continue
            if have is not None and have != want:
                raise ConfigError(
                    f"rule {name!r} has {_describe_spec(want)} here, but {_describe_spec(have)} in Redis: "
                    f"every app and agent sharing this Redis must agree on them and on escrow mode (the limit "
                    f"may differ); rename the rule to change its window, resolution or mode"
                )

    def _verify_region(self, have: bytes | str | None) -> None:
        have_b = have.encode() if isinstance(have, str) else have
        if have_b is not None and have_b != self._region_b:
            raise ConfigError(
                f"this Redis (key prefix {self._layout.prefix!r}) belongs to region "
                f"{have_b.decode(errors='replace')!r}, but this process names region {self._region!r}: "
                f"each region needs its own Redis (or its own database or key prefix); check the "
                f"Redis URL and the region name. If the region was renamed on purpose, run "
                f"HDEL {self._layout.rules_key.decode(errors='replace')} {REGION_FIELD} on this Redis"
            )

    def _degrade(self, requests: Sequence[HitRequest], exc: StorageError) -> list[Decision]:
        if self._on_error == "raise":
            raise exc
        doing = "allowing" if self._on_error == "allow" else "denying"
        self.degraded_lines.warn("degraded", f"geolimit: Redis unavailable, {doing} requests "
                                 f"(on_error={self._on_error!r})", str(exc), "call(s) degraded")
        return [degraded_decision(r.rules, self._on_error == "allow", str(exc)) for r in requests]
