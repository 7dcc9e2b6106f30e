"""Redis key layout.

Every key a script touches for one subject sits in one Redis Cluster hash slot.
The hash tag is a *virtual shard* derived from the subject, ``crc32(subject) % shards``,
so all rules of a subject, and the shard's bookkeeping keys, share a slot::

    gl:{17}:api:user:42     hash: the buckets of rule "api" for subject "user:42"
    gl:{17}#r               hash: slot registry of shard 17 ("@" = own incarnation)
    gl:{17}#c               hash: keys changed since the agent last drained shard 17
                            (recorded only while the agent's lease, registry field
                            "a", has not expired)
    gl:{17}#p               hash: peer freshness for prediction and partition
                            policies (region -> counts current until, "#R" -> regions)
    gl#rules                hash: rule name -> "window_us/resolution_us"

The subject is raw bytes after the rule name; braces, colons, spaces and any
other bytes are fine because the hash tag is the *first* ``{...}`` of the key
and rule names cannot contain ``:``.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

from geolimit.errors import ConfigError, RequestError

__all__ = ["MAX_SHARDS", "MAX_SUBJECT_BYTES", "KeyLayout", "encode_subject", "glob_escape"]

#: The most virtual shards of a key layout (``shards``).
MAX_SHARDS = 16384

MAX_SUBJECT_BYTES = 4096


def encode_subject(subject: str | bytes) -> bytes:
    """Subjects are bytes; ``str`` is encoded as UTF-8."""
    if isinstance(subject, str):
        data = subject.encode("utf-8", "surrogatepass")
    elif isinstance(subject, (bytes, bytearray, memoryview)):
        data = bytes(subject)
    else:
        raise RequestError(f"subject must be str or bytes, got {type(subject).__name__}")
    if len(data) > MAX_SUBJECT_BYTES:
        raise RequestError(
            f"subject is {len(data)} bytes; the maximum is {MAX_SUBJECT_BYTES} (hash long "
            f"identifiers before passing them)"
        )
    return data


@dataclass(frozen=True)
class KeyLayout:
    """Builds and parses geolimit's Redis keys.

    ``prefix`` namespaces everything (several independent limiters can share one
    Redis); ``shards`` is the number of virtual shards. Every app and the agent of
    one region must use the same layout; regions may differ.
    """

    prefix: str = "gl"
    shards: int = 64

    def __post_init__(self) -> None:
        if not isinstance(self.prefix, str) or not self.prefix or any(c in self.prefix for c in "{}#"):
            raise ConfigError(
                f"invalid key prefix {self.prefix!r}: must be non-empty and contain none of '{{', '}}', '#'"
            )
        if isinstance(self.shards, bool) or not isinstance(self.shards, int) or not 1 <= self.shards <= MAX_SHARDS:
            raise ConfigError(f"shards must be an integer from 1 to {MAX_SHARDS}, got {self.shards!r}")
        object.__setattr__(self, "_p", self.prefix.encode())
        object.__setattr__(
            self, "_tags", [self.prefix.encode() + b":{%d}" % s for s in range(self.shards)]
        )

    def shard_of(self, subject: bytes) -> int:
        return zlib.crc32(subject) % self.shards

    def tag(self, shard: int) -> bytes:
        """``b"gl:{17}"``: the common start of every key of a shard."""
        tags: list[bytes] = self._tags  # type: ignore[attr-defined]
        return tags[shard]

    def data_key(self, rule: str, subject: bytes) -> bytes:
        return self.tag(self.shard_of(subject)) + b":" + rule.encode() + b":" + subject

    def registry_key(self, shard: int) -> bytes:
        return self.tag(shard) + b"#r"

    def aux_keys(self, shard: int) -> tuple[bytes, bytes, bytes]:
        """``(registry, changed, peers)`` of a shard, in the order scripts expect."""
        tag = self.tag(shard)
        return tag + b"#r", tag + b"#c", tag + b"#p"

    @property
    def ae_requests_key(self) -> bytes:
        """The region's anti-entropy request list (replication/ae_requests.py), on shard 0's tag."""
        return self.tag(0) + b"#aq"

    @property
    def rules_key(self) -> bytes:
        return self.prefix.encode() + b"#rules"

    def data_pattern(self, shard: int | None = None) -> bytes:
        """A SCAN MATCH pattern for the data keys of one shard (``None``: of every shard)."""
        if shard is None:
            return glob_escape(self.prefix.encode()) + b":{*}:*"
        return glob_escape(self.tag(shard)) + b":*"

    def parse_data_key(self, key: bytes) -> tuple[int, str, bytes]:
        """``(shard, rule, subject)`` of a data key; :class:`~geolimit.errors.RequestError` if it is not one."""
        p: bytes = self._p  # type: ignore[attr-defined]
        close = key.find(b"}", len(p) + 2)
        rule, sep, subject = key[close + 2 :].partition(b":")
        shard = key[len(p) + 2 : close]
        if (not key.startswith(p + b":{") or close < 0 or key[close + 1 : close + 2] != b":" or not sep
                or not shard.isdigit()):
            raise RequestError(f"not a geolimit data key: {key!r}")
        try:
            return int(shard), rule.decode(), subject
        except UnicodeDecodeError:
            raise RequestError(f"not a geolimit data key: {key!r}") from None


def glob_escape(data: bytes) -> bytes:
    """``data`` with the glob metacharacters of SCAN MATCH escaped."""
    out = bytearray()
    for byte in data:
        if byte in b"*?[]\\":
            out += b"\\"
        out.append(byte)
    return bytes(out)
