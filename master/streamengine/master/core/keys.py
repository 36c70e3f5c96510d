"""The master's signing keys, pure: which one signs, which ones verify, and when each
one that no longer signs is retired.

Theory of operation. At any time one key signs: of the keys whose `signs_from_ms` has
come, the latest. A rotation adds a key that verifies at once and signs only from
`KEY_PUBLISH_MS` later, once every store has heard of it (stores learn the keys with
their heartbeats): a store never sees a grant or token signed by a key it does not hold
yet. From then on the old key only verifies what it signed, until all of it has
expired: its tokens (`signed_until_ms`, the latest expiry of a token it signed, kept
with every token created) and its grants (a grant lives at most `grant_ms`, and the
master signs and renews grants only with the signing key). That time
(`retiring_at_ms`) is set at the rotation and pushed back by any token the old key
signs before the new one takes over; once it has passed, the master retires the key
(`due_to_retire`) and stores, told the keys with every heartbeat, stop trusting it.

A verifier holds at most `VERIFYING_KEYS_MAX` keys (`protocol.signing`): a rotation that
would need more is refused until the oldest key retires.

Pure: time comes in as `now_ms` (wall-clock: tokens and grants outlive processes).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from streamengine.master.core.errors import ResourceExhausted
from streamengine.protocol.signing import KEY_ID_BYTES, VERIFYING_KEYS_MAX

# A new key signs once every store can have heard of it: stores hear from the master at
# least once a second (`state.STORE_HEARTBEAT_MS_MAX`); two heartbeats and a margin for
# one that failed.
KEY_PUBLISH_MS = 3000


@dataclass(frozen=True, slots=True)
class KeyRecord:
    """What the master keeps of one key beside its private bytes."""

    key_id: str  # hex, as envelopes name it (`protocol.signing.key_id`)
    created_at_ms: int
    # When it starts signing (0: from its creation, the cluster's first key).
    signs_from_ms: int = 0
    # When a newer key takes over signing (0: none has been added since).
    superseded_at_ms: int = 0
    # When a superseded key stops verifying: all it signed has expired by then.
    retiring_at_ms: int = 0
    # The latest expiry of a token this key signed (0: none).
    signed_until_ms: int = 0

    def __post_init__(self) -> None:
        assert len(self.key_id) == 2 * KEY_ID_BYTES, self
        assert bool(self.superseded_at_ms) == bool(self.retiring_at_ms), self
        assert self.retiring_at_ms >= self.superseded_at_ms, self

    def signs_at(self, now_ms: int) -> bool:
        superseded = self.superseded_at_ms and self.superseded_at_ms <= now_ms
        return self.signs_from_ms <= now_ms and not superseded


def signing_key(keys: Iterable[KeyRecord], now_ms: int) -> KeyRecord:
    """The key that signs at `now_ms`."""
    signing = [key for key in keys if key.signs_at(now_ms)]
    assert len(signing) == 1, (now_ms, signing)
    return signing[0]


def rotate(
    keys: Sequence[KeyRecord], new_key_id: str, now_ms: int, grant_ms: int
) -> tuple[KeyRecord, KeyRecord]:
    """(the latest key, superseded by the new one, the new key); raises
    ResourceExhausted when verifiers would hold too many keys."""
    assert grant_ms > 0 and all(key.key_id != new_key_id for key in keys), new_key_id
    if len(keys) >= VERIFYING_KEYS_MAX:
        oldest = min(key.retiring_at_ms for key in keys if key.superseded_at_ms)
        raise ResourceExhausted(
            f"{len(keys)} keys verify already, the most a store holds "
            f"(VERIFYING_KEYS_MAX); the first retires at {oldest} (wall-clock ms)"
        )
    latest = [key for key in keys if not key.superseded_at_ms]
    assert len(latest) == 1, latest
    takes_over_ms = now_ms + KEY_PUBLISH_MS
    superseded = replace(
        latest[0],
        superseded_at_ms=takes_over_ms,
        retiring_at_ms=max(latest[0].signed_until_ms, takes_over_ms + grant_ms),
    )
    return superseded, KeyRecord(new_key_id, now_ms, signs_from_ms=takes_over_ms)


def due_to_retire(keys: Iterable[KeyRecord], now_ms: int) -> list[str]:
    """The ids of the keys whose signatures have all expired by `now_ms`, oldest first."""
    due = [key for key in keys if key.superseded_at_ms and key.retiring_at_ms <= now_ms]
    return [key.key_id for key in sorted(due, key=lambda key: (key.signs_from_ms, key.key_id))]


def token_signed(key: KeyRecord, expires_at_ms: int) -> KeyRecord:
    """`key` after it signed a token that expires at `expires_at_ms`."""
    signed = replace(key, signed_until_ms=max(key.signed_until_ms, expires_at_ms))
    if key.superseded_at_ms:
        return replace(signed, retiring_at_ms=max(key.retiring_at_ms, expires_at_ms))
    return signed


def listing_order(keys: Iterable[KeyRecord]) -> list[KeyRecord]:
    """Newest first (as `key list` shows them, and stores are told them)."""
    return sorted(keys, key=lambda key: (-key.signs_from_ms, -key.created_at_ms, key.key_id))
