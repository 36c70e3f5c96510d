"""The master's segment records kept by the stores, as both sides name their versions.

The master sends each copy-set store its record of a segment (`v1.SegmentRecord`,
serialized) with a heartbeat reply whenever the record changed; the store keeps the
bytes beside the segment and reports their version with every heartbeat, so the master
sends a record again only when the two differ. A version is a digest of the bytes: no
counter to keep, and a master rebuilt from the stores compares the same way. The
cluster view each store keeps (every store the master knows, the highest stream id it
gave) goes the same way, one per store.
"""

from __future__ import annotations

import hashlib

# Records one heartbeat reply carries at most: a store that holds many segments without
# records (after an upgrade, or a rebuild) catches up over several heartbeats instead of
# one reply of unbounded size. A record is well under 4 KiB (a 256 MiB segment's
# certificate has 64 chunks of 40 bytes), so a reply stays under 1 MiB.
RECORDS_PER_HEARTBEAT_MAX = 128
# A record larger than this is malformed (a store refuses to keep it).
RECORD_BYTES_MAX = 64 << 10
# A cluster view (`v1.ClusterView`: the master's store ids and highest stream id) larger
# than this is malformed (a store refuses to keep it): some ten thousand store ids.
CLUSTER_VIEW_BYTES_MAX = 1 << 20
# Streams a cluster view carries at most (the newest no store keeps a record of: created
# and not yet written, or whose records reached no store yet), some 100 KiB of names.
CLUSTER_VIEW_STREAMS_MAX = 1024


def record_version(raw: bytes) -> int:
    """The version of a record's bytes: never 0 (0 says "no record")."""
    assert raw, "an empty record has no version"
    return int.from_bytes(hashlib.sha256(raw).digest()[:8], "big") or 1
