"""Anti-entropy that holds at a million live keys per region.

Two regions compare what they hold for the *live window* of the initiator's
clock (buckets ``[c - N, c + F]`` of every rule both sides share; a periodic
exchange with ``settle`` stops at the last bucket that ended ``settle`` before
``now``, leaving the cells deltas still carry to gossip) and repair the
differences, in many small steps:

1. **Digests, in Redis.** ``ae_scan.lua`` walks the node's keys with ``SCAN``
   in bounded pages (a few hundred keys, at most ~8k hash fields per call) and
   returns, per key, its *leaf* and its *digest*. A key's digest is the sum
   (mod 2**52) of one hash per live non-zero cell ``(bucket, slot id, value,
   floor)`` (see ``ae_common.lua``): independent of storage order, of slot
   indices, and of how a big key is split into chunks (``ae_key.lua``). A key's
   leaf is ``sha1(rule:subject)`` modulo ``L`` leaves of its shard. Python only
   adds each page into two arrays of fixed size (``shards * L`` leaf digests
   and key counts, about 2**18), and awaits Redis between pages. A page stops
   after ``page_keys`` keys or about ``page_ms`` of Redis time; the next one is
   requested before a reply is processed; an optional pacer (``duty``) bounds
   the scripts' share of a Redis's time.
2. **Merkle descent.** Sums are additive, so a range's digest is the sum of its
   leaves': the initiator asks for the responder's digests of all shards, then
   of the 16 sub-ranges of each shard that differs, and so on down to leaves.
   Equal regions exchange one digest per shard.
3. **Listing.** For the differing leaves (capped at ``max_keys`` keys a run,
   judged by both sides' counts), both sides run a second pass that lists
   ``(shard, rule:subject, digest)`` of the keys in those leaves; the initiator
   pulls the responder's list page by page and compares key by key. A key a
   region holds but may not exchange (``checks._Unexchangeable``: a subject over
   ``MAX_SUBJECT_BYTES`` or of another shard, which an older agent merged) is
   left out of its listing, and skipped in a peer's, counted in ``keys_skipped``.
4. **Repair.** The initiator reads the responder's cells of keys that differ or
   that it lacks (``read`` steps; ``ae_read.lua`` returns merge blobs) and
   merges them with the ``merge`` callback, and pushes its own cells of keys
   that differ or that the responder lacks (``push`` steps). Merging is a max,
   so a key that differs both ways travels both ways.

The responder does its passes in background tasks and answers "not ready" until
they are done, so no request waits for a scan. Its state is kept per exchange
id (at most :data:`MAX_EXCHANGES_PER_PEER` per peer, dropped after
``exchange_ttl`` seconds without a request). Every field of every payload (and
of every reply) is checked; bad input raises :class:`ProtocolError` before
anything is written.

Steps (``payload["op"]``; ``x`` is the 16-byte exchange id)::

    begin   {x, now, shards, leaves, rules: [[name, window_us, res_us], ...], settle?}
            -> {x, rules: [accepted names]}          (responder starts pass 1)
    tree    {x, level, nodes: [node, ...]}            (<= 2048 nodes)
            -> {ready: false, scanned} | {ready: true, d: 8 bytes/node, c: 4 bytes/node}
    list    {x, leaves: bitmap of shards*L bits}      -> {ok}  (starts the listing)
    entries {x, from}    -> {ready, total, truncated, e: [[shard, rule:subject, digest], ...]}
    read    {x, keys: [[shard, rule:subject], ...], pos} -> {blobs: [[shard, blob]], done, pos}
    push    {x, blobs: [[shard, blob], ...]}          -> {ok, cells}
    end     {x}                                        -> {ok}

A node of level ``k`` is ``shard * n_k + i`` where ``n_0 = 1`` and each level
has 16 times as many nodes per shard as the one above, down to ``n = L``
(leaves). Digests are big-endian 64-bit, counts big-endian 32-bit.
"""


from geolimit.replication.antientropy.checks import check_blob
from geolimit.replication.antientropy.common import (
    MAX_BLOB_CELLS,
    AntiEntropyResult,
    cell_sums,
    digest_of_cells,
    key_digest,
    key_seed,
    slot_code,
)
from geolimit.replication.antientropy.initiator import AntiEntropy

__all__ = [
    "MAX_BLOB_CELLS",
    "AntiEntropy",
    "AntiEntropyResult",
    "cell_sums",
    "check_blob",
    "digest_of_cells",
    "key_digest",
    "key_seed",
    "slot_code",
]
