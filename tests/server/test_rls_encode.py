"""The agent's hand-written RateLimitResponse bytes (geolimit/server/rls/encode.py) are what
Envoy's own message classes (the `xds-protos` package) serialize, byte for byte."""

from __future__ import annotations

from envoy.service.ratelimit.v3 import rls_pb2
from hypothesis import given
from hypothesis import strategies as st

from geolimit.core.rule import Rule
from geolimit.server.rls.decide import UNLIMITED_REMAINING, Answer, Status
from geolimit.server.rls.descriptors import UNIT_CODES, Limit
from geolimit.server.rls.encode import encode_response

_OK, _OVER = rls_pb2.RateLimitResponse.OK, rls_pb2.RateLimitResponse.OVER_LIMIT


def reference(result: Answer) -> bytes:
    """The response as the protobuf runtime builds and serializes it."""
    response = rls_pb2.RateLimitResponse(overall_code=_OVER if result.over_limit else _OK)
    for s in result.statuses:
        status = response.statuses.add(code=_OVER if s.over_limit else _OK, limit_remaining=s.remaining)
        if s.limit is not None and s.limit.rule is not None:
            current = status.current_limit
            current.name = s.limit.rule.name
            current.requests_per_unit = s.limit.requests_per_unit
            current.unit = UNIT_CODES[s.limit.unit]
        if s.reset_after is not None:
            micros = round(s.reset_after * 1e6)
            status.duration_until_reset.seconds = micros // 1_000_000
            status.duration_until_reset.nanos = micros % 1_000_000 * 1000
    for key, value in result.headers:
        response.response_headers_to_add.add(key=key, value=value)
    return response.SerializeToString()


NAMES = st.from_regex(r"[A-Za-z0-9_.-]{1,64}", fullmatch=True)


@st.composite
def limits(draw: st.DrawFn) -> Limit | None:
    kind = draw(st.sampled_from(["none", "unlimited", "limited"]))
    if kind == "none":
        return None
    if kind == "unlimited":
        return Limit("d.k", None)
    unit = draw(st.sampled_from(sorted(UNIT_CODES)))
    per_unit = draw(st.integers(1, 2**32 - 1))
    rule = Rule(draw(NAMES), per_unit, 1.0)
    return Limit("d.k", rule, unit, per_unit, shadow=draw(st.booleans()))


@st.composite
def statuses(draw: st.DrawFn) -> Status:
    result = draw(st.sampled_from(["ok", "over_limit", "shadow_over_limit", "unlimited", "no_limit"]))
    reset = draw(st.none() | st.floats(0, 10**7, allow_nan=False) | st.sampled_from([0.0, 1.0, 0.5, 59.999999]))
    return Status(result, draw(limits()), draw(st.integers(0, UNLIMITED_REMAINING)), reset, "m")


answers = st.builds(
    Answer,
    st.booleans(),
    st.lists(statuses(), min_size=1, max_size=5),
    st.lists(st.tuples(st.text(max_size=30), st.text(max_size=300)), max_size=4),
)


@given(answers)
def test_hand_written_bytes_equal_the_protobuf_runtime(result: Answer) -> None:
    assert encode_response(result) == reference(result)


def test_the_usual_answer_parses_back() -> None:
    rule = Rule("d.user-per-minute", 10, 60.0)
    ok = Status("ok", Limit("d.user", rule, "minute", 10), 7, 59.5, "d.user")
    headers = [("RateLimit-Policy", '"d.user-per-minute";q=10;w=60'), ("RateLimit", '"d.user-per-minute";r=7;t=59')]
    parsed = rls_pb2.RateLimitResponse.FromString(encode_response(Answer(False, [ok], headers)))
    assert parsed.overall_code == _OK
    assert parsed.statuses[0].current_limit.name == "d.user-per-minute"
    assert parsed.statuses[0].current_limit.unit == rls_pb2.RateLimitResponse.RateLimit.MINUTE
    assert parsed.statuses[0].limit_remaining == 7
    assert parsed.statuses[0].duration_until_reset.ToMicroseconds() == 59_500_000
    assert [(h.key, h.value) for h in parsed.response_headers_to_add] == headers
