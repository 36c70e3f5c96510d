"""Epoch grants: the master's signed word that one client leads one epoch of a stream.

Every epoch the master grants (a lease grant, a roll) comes with a `Grant`, signed
(`protocol.signing`): the stream id and its tenant, the epoch, the client id it was
granted to, and the segments the holder may write and seal under it with their copy
sets: the segment of the epoch itself (absent when the epoch was granted without one)
and every earlier segment then unsealed, which the holder must seal and recover.

Stores take a `Write` or a `Seal` only with a valid grant of the writer's epoch that
lists the segment and the store in its copy set (`segment_store.authority`). The master
takes `SealSegment`, `ReleaseLease` and `RollSegment` only with the grant of the
caller's epoch (`master.authority`). So fencing a stream, or ending a lease, takes a
grant from the master, not just a route to a server: a stale or buggy writer holds only
grants of old epochs, and a forged grant does not verify.

A grant expires (`expires_at_ms`, wall-clock): stores refuse it after that
(`Grant.expired`), so a grant copied off a leader's host dies within one bound
(`GRANT_MS_DEFAULT`) even while its epoch is still the latest. The honest leader never
sees the refusal: every answer to its lease renewals carries its grant, renewed by the
master once less than half of its life is left (`master.core.authority.grant_expiry`),
and the leader shows the renewed one to its stores. Beside expiry a grant is as good as
its epoch, which stores fence. The copy sets in it never go stale: an open or sealing
segment's copy set never changes (repair swaps members only of sealed segments, which
no leader seals again).

Encoding (canonical, `PayloadWriter`): stream id u64 | epoch u64 | expires at u64 |
tenant | client id | segment count u8 | per segment, oldest first: epoch u64 | member
count u8 | store ids. The magic `SEG2` names this format; `SEG1` grants (which carried no
expiry) are refused as of another format version.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from streamengine.protocol.limits import EPOCH_MAX, REPLICAS_MAX, UNSEALED_SEGMENTS_MAX
from streamengine.protocol.signing import (
    MalformedPayload,
    PayloadReader,
    PayloadWriter,
    SignatureRefused,
    SigningKey,
    Verifier,
)

GRANT_MAGIC = b"SEG2"
# How long a grant is good for. Stores compare it with their own wall clock, so it must
# dwarf the skew between hosts; the shorter it is, the sooner a stolen grant dies. The
# master renews a leader's grant when half of it is left (`grant_expiry`), and that
# half must outlast a lease (`GRANT_MS_MIN_LEASES`): a leader that hears nothing from
# the master for a lease stops leading before its grant can expire.
GRANT_MS_DEFAULT = 10 * 60 * 1000
GRANT_MS_MIN_LEASES = 4
# The segment of the epoch and every earlier one unsealed when it was granted.
GRANT_SEGMENTS_MAX = UNSEALED_SEGMENTS_MAX + 1
# Distinct grants the master keeps signed (one per leading stream; signing costs more
# than the rest of an answer, docs/performance.md, and leaders are answered a few times
# a second each).
SIGNED_GRANTS_CACHED_MAX = 4096


@dataclass(frozen=True, slots=True)
class GrantSegment:
    """A segment the grant's holder may write and seal, and the stores holding it."""

    epoch: int
    copy_set: tuple[str, ...]

    def __post_init__(self) -> None:
        assert 0 < self.epoch <= EPOCH_MAX, self
        assert 0 < len(self.copy_set) <= REPLICAS_MAX, self
        assert len(set(self.copy_set)) == len(self.copy_set), self
        assert all(self.copy_set), self


@dataclass(frozen=True, slots=True)
class Grant:
    stream_id: int
    epoch: int
    tenant: str
    client_id: str
    # Oldest first: every earlier segment unsealed at the grant, then (when the epoch
    # was granted with one) the epoch's own segment.
    segments: tuple[GrantSegment, ...]
    # Wall-clock ms from which stores refuse it.
    expires_at_ms: int
    # The stream's name, as the master vouches for it: a store keeps it with the first
    # write or seal that brings the stream there, so that a master rebuilding lost
    # metadata names the stream though none of its records reached a store ("" in
    # grants made without it), and its write quorum (0: not said): the copy sets give
    # the number of replicas, and a stream rebuilt from grants keeps the quorum it was
    # created with, not a majority of them.
    stream_name: str = ""
    write_quorum: int = 0

    def __post_init__(self) -> None:
        assert self.stream_id > 0 and 0 < self.epoch <= EPOCH_MAX, self
        assert 0 < self.expires_at_ms < 1 << 64, self
        assert self.tenant and self.client_id, self
        assert len(self.segments) <= GRANT_SEGMENTS_MAX, self
        assert 0 <= self.write_quorum <= REPLICAS_MAX, self
        epochs = [segment.epoch for segment in self.segments]
        assert epochs == sorted(set(epochs)) and all(e <= self.epoch for e in epochs), self

    def segment(self, epoch: int) -> GrantSegment | None:
        for segment in self.segments:
            if segment.epoch == epoch:
                return segment
        return None

    def encode(self) -> bytes:
        out = PayloadWriter().u64(self.stream_id).u64(self.epoch).u64(self.expires_at_ms)
        out.text(self.tenant).text(self.client_id).u8(len(self.segments))
        for segment in self.segments:
            out.u64(segment.epoch).u8(len(segment.copy_set))
            for store in segment.copy_set:
                out.text(store)
        return out.text(self.stream_name).u8(self.write_quorum).bytes()

    @classmethod
    def decode(cls, payload: bytes) -> Grant:
        """Raises MalformedPayload unless `payload` is a grant's canonical encoding."""
        reader = PayloadReader(payload)
        stream_id, epoch, expires_at_ms = reader.u64(), reader.u64(), reader.u64()
        tenant, client_id = reader.text(), reader.text()
        if not (stream_id > 0 and 0 < epoch <= EPOCH_MAX and tenant and client_id):
            raise MalformedPayload("a grant needs a stream, an epoch, a tenant and a client")
        if not expires_at_ms:
            raise MalformedPayload("a grant without an expiry")
        count = reader.u8()
        if count > GRANT_SEGMENTS_MAX:
            raise MalformedPayload(f"a grant of {count} segments")
        segments: list[GrantSegment] = []
        for _ in range(count):
            segment_epoch, members = reader.u64(), reader.u8()
            copy_set = tuple(reader.text() for _ in range(members))
            previous = segments[-1].epoch if segments else 0
            if not (previous < segment_epoch <= epoch and 0 < members <= REPLICAS_MAX):
                raise MalformedPayload("grant segments out of order or of no store")
            if len(set(copy_set)) != members or not all(copy_set):
                raise MalformedPayload("a grant's copy set names a store twice, or none")
            segments.append(GrantSegment(segment_epoch, copy_set))
        stream_name, write_quorum = reader.text(), reader.u8()
        if write_quorum > REPLICAS_MAX:
            raise MalformedPayload(f"a grant of write quorum {write_quorum}")
        reader.finish()
        return cls(
            stream_id,
            epoch,
            tenant,
            client_id,
            tuple(segments),
            expires_at_ms,
            stream_name,
            write_quorum,
        )

    def expired(self, now_ms: int) -> bool:
        return now_ms >= self.expires_at_ms

    def expiry_note(self, now_ms: int) -> str:
        """Why an expired grant is refused, in words a log reader can act on."""
        return (
            f"the grant of epoch {self.epoch} of stream {self.stream_id} expired at "
            f"{self.expires_at_ms} (wall-clock ms; now {now_ms}): its holder renews it "
            "with its lease"
        )


class GrantSigner:
    """Signs grants for the master, each distinct grant once (Ed25519 signatures are
    deterministic: the same grant always signs to the same bytes)."""

    def __init__(self, key: SigningKey, cached_max: int = SIGNED_GRANTS_CACHED_MAX) -> None:
        self.key = key
        self._cached_max = cached_max
        self._signed: OrderedDict[Grant, bytes] = OrderedDict()

    def sign(self, grant: Grant) -> bytes:
        signed = self._signed.get(grant)
        if signed is None:
            signed = self.key.sign(GRANT_MAGIC, grant.encode())
            self._signed[grant] = signed
            if len(self._signed) > self._cached_max:
                self._signed.popitem(last=False)
        else:
            self._signed.move_to_end(grant)
        return signed


def open_grant(verifier: Verifier, signed: bytes) -> Grant:
    """The grant in `signed`; raises SignatureRefused (forged, of another cluster,
    malformed) or NoVerifyingKey."""
    try:
        return verifier.open(GRANT_MAGIC, signed, Grant.decode)
    except MalformedPayload as error:
        # Signed by the master yet malformed: only a master bug makes one. Nothing in
        # it is trusted either way.
        raise SignatureRefused(f"a malformed grant: {error}") from None
