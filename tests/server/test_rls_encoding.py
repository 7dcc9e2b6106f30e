"""The RLS script's arguments, pre-encoded (the agent's hot path) and as a list, agree byte for byte."""

from __future__ import annotations

from geolimit.core.keys import KeyLayout
from geolimit.server.rls.decide import (
    Descriptor,
    Transaction,
    encode_batch,
    encode_batch_resp,
    plan,
)
from geolimit.server.rls.descriptors import parse_rls
from geolimit.store.protocol import RulePlan, bulk

RLS = parse_rls([("<test>", {"domain": "d", "descriptors": [
    {"key": "user", "rate_limit": {"unit": "minute", "requests_per_unit": 10}},
    {"key": "path", "rate_limit": {"unit": "hour", "requests_per_unit": 1000}},
    {"key": "ip", "rate_limit": {"unit": "second", "requests_per_unit": 5}, "shadow_mode": True},
]})])
LAYOUT = KeyLayout("gl", 16)


def transaction(*descriptors: tuple[tuple[tuple[str, str], ...], int]) -> Transaction:
    plans: dict[str, RulePlan] = {}
    return plan(RLS.domains["d"], "d", [Descriptor(e, c) for e, c in descriptors], LAYOUT, plans)


def as_resp(args: list[bytes]) -> tuple[int, bytes]:
    return len(args), b"".join(map(bulk, args))


def test_pre_encoded_arguments_equal_the_list_form() -> None:
    one = transaction(((("user", "u1"),), 1))  # one request: the one-pass form
    several = transaction(((("user", "u2"),), 3), ((("path", "/a"),), 1), ((("ip", "10.0.0.1"),), 1),
                          ((("user", "u2"),), 2))  # same counter twice, a shadow counter, other shards
    unlimited = transaction(((("nothing", "x"),), 1))
    assert len(one.requests) == 1
    assert len(several.requests) >= 3
    for batch in ([one], [several], [one, several, one], [unlimited, one]):
        for now in (None, 1_795_736_232_000_000):
            assert encode_batch_resp(batch, now, b"eu", b"abc123") == as_resp(encode_batch(batch, now, b"eu", b"abc123"))
