"""The store's authority rules, pure: which grants it takes, what it trusts, quotas.

Grants (`protocol.grants`). A store takes a `Write` or a `Seal` only under a grant of
the master that verifies with one of the master's keys and that says: this stream,
this epoch (the writer's, or the sealer's new one), and this segment with this store in
its copy set (`check_grant`; an earlier segment as the grant lists the unsealed ones,
with their own copy sets), and that has not expired by the store's wall clock. Anything
else is refused, before anything is written: `GrantRefused` (PERMISSION_DENIED), its
`GrantExpired` naming the expiry. A store that has no key of its master yet cannot
tell: `NoSigningKeyYet` (UNAVAILABLE, retried). Grants are required whether or not the
cluster runs TLS: they fence stale and buggy writers as well as hostile ones.

A Write stream shows each grant once (`WriteStreamGrants`): its first request of a
(stream, writer epoch) carries it, later ones may not; the verified grant is kept for
the stream's lifetime, and checked for expiry at every write (a leader shows its
renewed grant on its next request). The stream's token, proven once at its open, is
checked against the revocations at every write too: a revocation the store hears of
ends the streams opened under that token (UNAUTHENTICATED). Verifying costs more than
the rest of a small write's handling (docs/performance.md, "Signatures"), so the
`Verifier` also caches across streams and seals: one verification per grant per store.

What it trusts (`StoreAuthority`): the master's public keys and its token revocations,
both from the master's replies (`update`), kept durably (`AuthorityRecord`, written by
the core) so that after a restart the store checks grants and tokens before the master
answers; and keys pinned by the operator (`--trust-signing-key`), kept beside them.

Quotas (`AppendQuota`): a token bucket of payload bytes per tenant, refilled at the
master's `tenant_append_bytes_per_s`: a batch over it is refused (REFUSED_QUOTA) and
resent later by its leader, as under back pressure.

No resource before authentication (`CallerShares`): a streaming call (Write, Subscribe,
Read) proves who calls when it opens, from its metadata, before any message is read; a
caller anonymous on a secured store is refused at once (UNAUTHENTICATED), so it never
holds one of the store's concurrent calls. Each principal then holds at most
`STREAMS_PER_PRINCIPAL_MAX` open streaming calls (beyond: RESOURCE_EXHAUSTED naming the
limit) and a share of the write queue (`QUEUE_SHARE_PER_PRINCIPAL`; beyond: its batches
are held back, REFUSED_BUSY, while others' still go in), so no one caller can take the
whole store from the others. The grants and the tenant of each request are still
checked per request, as above.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from streamengine.protocol.auth import Principal, PrincipalKind, authorize, describe
from streamengine.protocol.grants import Grant, open_grant
from streamengine.protocol.open_calls import OpenCalls
from streamengine.protocol.signing import (
    PUBLIC_KEY_BYTES,
    VERIFYING_KEYS_MAX,
    MalformedPayload,
    NoVerifyingKey,
    PayloadReader,
    PayloadWriter,
    SignatureRefused,
    Verifier,
)
from streamengine.protocol.tokens import Revocations
from streamengine.segment_store.core.commands import SegmentKey
from streamengine.segment_store.core.errors import StoreError

# Grants one Write stream keeps: a client's stream carries one epoch per stream it leads
# (ten thousand streams led through one store, issue #38), a recovery's a few; beyond
# it the oldest is forgotten (its next request is refused and the grant shown again).
# A verified grant is a few hundred bytes: 16384 of them cost a stream a few MiB.
GRANTS_PER_WRITE_STREAM_MAX = 1 << 14
# Revocations a store keeps: tokens revoked before they expire, at most a year ahead.
REVOCATIONS_MAX = 1 << 16
# Streaming calls one principal may hold open on a store at once. A leader holds one
# Write stream per stream it leads on the store, a follower one Subscribe per segment it
# tails, so an application leading hundreds of streams under one token needs hundreds.
# The store's concurrent calls (`server.CONCURRENT_RPCS_MAX`) keep
# `CALLS_LEFT_TO_OTHERS_MIN` beyond it, so that a principal opening and idling all it
# may leaves room for leaders, recoveries, repairs and readers of others.
STREAMS_PER_PRINCIPAL_MAX = 384
CALLS_LEFT_TO_OTHERS_MIN = 128
# One principal's unanswered write batches fill at most this fraction of the store's
# write queue (`--queue-bytes-max`): a tenant flooding a store is held back
# (REFUSED_BUSY) while the others' batches still find room.
QUEUE_SHARE_PER_PRINCIPAL = 0.25


class GrantRefused(StoreError):
    """A Write or Seal without a valid grant of its epoch for this segment and store."""


class GrantExpired(GrantRefused):
    """A grant past its expiry: stolen, or held by a leader that stopped renewing."""


class CallerRefused(StoreError):
    """The caller may not make this call (its certificate or token)."""


class CallerUnproven(StoreError):
    """The caller's certificate proof does not hold (UNAUTHENTICATED: it must hear why)."""


class OverCallerLimit(StoreError):
    """The caller holds all a store gives one principal (RESOURCE_EXHAUSTED); others
    keep the rest."""


def ends_write_stream(error: StoreError) -> bool:
    """Whether a refused Write request ends its whole stream. A stream carries the
    segments of every writer of one client: a refusal about one segment (its grant, its
    fence, its input, the stream deleted) is answered on that request alone and the
    others go on; only a caller that cannot prove who it is loses the stream."""
    return isinstance(error, CallerUnproven | OverCallerLimit)


class NoSigningKeyYet(StoreError):
    """The store knows no key of its master yet: it cannot check grants or tokens."""


class StreamDeleted(StoreError):
    """The master deleted the stream (pending removal): no writes, no live tails."""

    def __init__(self, message: str, deleted_until_ms: int):
        self.deleted_until_ms = deleted_until_ms
        super().__init__(message)


@dataclass(frozen=True, slots=True)
class Deletion:
    """A stream the master lists as deleted: when its data goes, and its latest epoch
    when it was deleted (0: unknown)."""

    deleted_until_ms: int
    fenced_through_epoch: int = 0

    def admits(self, writer_epoch: int) -> bool:
        """Whether a write under `writer_epoch` goes on: the master grants no epoch
        while a stream is deleted, so a later one was granted after an undelete that
        this store has not heard of yet."""
        return bool(self.fenced_through_epoch) and writer_epoch > self.fenced_through_epoch


def check_grant(
    grant: Grant, store_id: str, segment: SegmentKey, epoch: int, now_ms: int
) -> None:
    """Raise GrantRefused unless `grant` lets its holder write or seal `segment` on
    `store_id` under `epoch` at `now_ms` (wall-clock), GrantExpired when it would but
    has expired."""
    if grant.stream_id != segment.stream_id:
        raise GrantRefused(
            f"the grant is of stream {grant.stream_id}, not of stream {segment.stream_id}"
        )
    if grant.epoch != epoch:
        raise GrantRefused(f"the grant is of epoch {grant.epoch}, not of epoch {epoch}")
    listed = grant.segment(segment.epoch)
    if listed is None:
        raise GrantRefused(f"the grant of epoch {epoch} does not list segment {segment.epoch}")
    if store_id not in listed.copy_set:
        raise GrantRefused(
            f"store {store_id} is not in the copy set of segment {segment.epoch} "
            f"({', '.join(listed.copy_set)})"
        )
    if grant.expired(now_ms):
        raise GrantExpired(grant.expiry_note(now_ms))


@dataclass(frozen=True, slots=True)
class AuthorityRecord:
    """What a store keeps of its master's authority: its keys and its revocations."""

    master_keys: tuple[bytes, ...] = ()
    revocations_version: int = 0
    revoked: tuple[tuple[str, int], ...] = ()

    def encode(self) -> bytes:
        out = PayloadWriter().u8(len(self.master_keys))
        for key in self.master_keys:
            assert len(key) == PUBLIC_KEY_BYTES
            out.text(key.hex())
        out.u64(self.revocations_version).u64(len(self.revoked))
        for token_id, expires_at_ms in self.revoked:
            out.text(token_id).u64(expires_at_ms)
        return out.bytes()

    @classmethod
    def decode(cls, raw: bytes) -> AuthorityRecord:
        reader = PayloadReader(raw)
        try:
            keys = tuple(bytes.fromhex(reader.text()) for _ in range(reader.u8()))
        except ValueError:
            raise MalformedPayload("a kept key is not hex") from None
        version, count = reader.u64(), reader.u64()
        if count > REVOCATIONS_MAX or any(len(k) != PUBLIC_KEY_BYTES for k in keys):
            raise MalformedPayload("kept authority out of bounds")
        revoked = tuple((reader.text(), reader.u64()) for _ in range(count))
        reader.finish()
        return cls(keys, version, revoked)


class StoreAuthority:
    """The keys and revocations a store trusts, and its checks of grants and callers."""

    def __init__(
        self,
        store_id: str,
        kept: AuthorityRecord | None = None,
        pinned_keys: Sequence[bytes] = (),
    ) -> None:
        assert store_id
        self.store_id = store_id
        self.pinned_keys = tuple(pinned_keys)
        kept = kept or AuthorityRecord()
        self.master_keys = kept.master_keys
        self.verifier = Verifier(self._keys())
        self.revocations = Revocations(dict(kept.revoked), kept.revocations_version)
        # Streams the master deleted, pending removal, by stream id.
        # Memory only: each heartbeat reply carries the whole list again.
        self.deleted_streams: dict[int, Deletion] = {}

    def _keys(self) -> list[bytes]:
        keys = list(dict.fromkeys([*self.master_keys, *self.pinned_keys]))
        return keys[:VERIFYING_KEYS_MAX]

    def record(self) -> AuthorityRecord:
        return AuthorityRecord(
            self.master_keys, self.revocations.version, tuple(self.revocations.items())
        )

    def update(
        self,
        master_keys: Sequence[bytes],
        revocations_version: int,
        revoked: Iterable[tuple[str, int]] | None,
        now_ms: int,
    ) -> bool:
        """Take what the master said; `revoked` is None when its revocations are those
        of our version. True when something changed that must be kept durably."""
        changed = False
        keys = tuple(k for k in master_keys if len(k) == PUBLIC_KEY_BYTES)
        if keys and keys != self.master_keys:
            self.master_keys = keys
            self.verifier.set_keys(self._keys())
            changed = True
        if revoked is not None and revocations_version != self.revocations.version:
            self.revocations.replace(list(revoked)[:REVOCATIONS_MAX], revocations_version)
            changed = True
        before = len(self.revocations)
        self.revocations.prune(now_ms)
        return changed or len(self.revocations) != before

    def check_not_deleted(self, stream_id: int, writer_epoch: int | None = None) -> None:
        """Refuse a live tail (`writer_epoch` None) of a stream the master deleted, or a
        write under an epoch granted before its delete."""
        deletion = self.deleted_streams.get(stream_id)
        if deletion is None or (writer_epoch is not None and deletion.admits(writer_epoch)):
            return
        until = deletion.deleted_until_ms
        raise StreamDeleted(
            f"stream {stream_id} is deleted: its data goes at {until} (wall-clock ms) "
            "unless it is undeleted before",
            until,
        )

    def check_not_revoked(self, principal: Principal) -> None:
        """Raise CallerUnproven when `principal`'s token was revoked since its call was
        proven: a streaming call proves its caller once, when it opens, and a revocation
        heard of later must still end it."""
        if principal.token_id and principal.token_id in self.revocations:
            raise CallerUnproven(f"token {principal.token_id} was revoked")

    def open_grant(self, signed: bytes) -> Grant:
        try:
            return open_grant(self.verifier, signed)
        except NoVerifyingKey as error:
            raise NoSigningKeyYet(str(error)) from None
        except SignatureRefused as error:
            raise GrantRefused(f"the grant does not verify: {error}") from None

    def grant_for(
        self,
        principal: Principal,
        rpc: str,
        signed: bytes,
        segment: SegmentKey,
        epoch: int,
        now_ms: int,
    ) -> Grant:
        """The grant of a Seal (or a Write stream's first request of an epoch), checked
        against the segment, this store, the time (wall-clock) and the caller."""
        if not signed:
            raise GrantRefused(f"{rpc} of segment {segment.epoch} at epoch {epoch} needs a grant")
        grant = self.open_grant(signed)
        check_grant(grant, self.store_id, segment, epoch, now_ms)
        denial = authorize(principal, rpc, grant.tenant, grant.stream_id)
        if denial is not None:
            raise CallerRefused(denial.reason)
        return grant


class WriteStreamGrants:
    """The grants one Write stream has shown, by (stream id, epoch)."""

    def __init__(self, authority: StoreAuthority, principal: Principal) -> None:
        self.authority = authority
        self.principal = principal
        self._grants: OrderedDict[tuple[int, int], Grant] = OrderedDict()

    def admit(
        self, signed: bytes, segment: SegmentKey, writer_epoch: int, now_ms: int
    ) -> Grant:
        """The grant a write to `segment` at `writer_epoch` goes under at `now_ms`
        (wall-clock): the one it carries, or the one shown earlier on this stream.
        Raises GrantRefused (GrantExpired), CallerRefused, NoSigningKeyYet, or
        CallerUnproven once the stream's token is revoked (which ends the stream)."""
        self.authority.check_not_revoked(self.principal)
        key = (segment.stream_id, writer_epoch)
        if signed:
            grant = self.authority.grant_for(
                self.principal, "SegmentStore/Write", signed, segment, writer_epoch, now_ms
            )
            self._grants[key] = grant
            self._grants.move_to_end(key)
            if len(self._grants) > GRANTS_PER_WRITE_STREAM_MAX:
                self._grants.popitem(last=False)
            return grant
        shown = self._grants.get(key)
        if shown is None:
            raise GrantRefused(
                f"no grant of epoch {writer_epoch} for stream {segment.stream_id} was shown "
                "on this Write stream"
            )
        # Already verified and authorized; this segment may be another one it lists.
        check_grant(shown, self.authority.store_id, segment, writer_epoch, now_ms)
        return shown


@dataclass
class AppendQuota:
    """Payload bytes per second each tenant may append through this store."""

    bytes_per_s: int
    # tenant -> (bytes it may still append, when that was computed)
    _buckets: dict[str, tuple[float, int]] = field(default_factory=dict)

    def admit(self, tenant: str, payload_bytes: int, now_ms: int) -> bool:
        """Whether a batch of `payload_bytes` may be written now; if so, it is counted.
        A bucket holds one second of the rate and may go into debt by one batch (a
        batch larger than the bucket passes once it is full): the next one waits until
        the debt is paid back."""
        if self.bytes_per_s <= 0 or payload_bytes == 0:
            return True
        capacity = float(self.bytes_per_s)
        tokens, at_ms = self._buckets.get(tenant, (capacity, now_ms))
        tokens = min(capacity, tokens + max(0, now_ms - at_ms) * self.bytes_per_s / 1000)
        if tokens <= 0:
            self._buckets[tenant] = (tokens, now_ms)
            return False
        self._buckets[tenant] = (tokens - payload_bytes, now_ms)
        return True


class CallerShares:
    """What each principal holds of a store: its open streaming calls and the payload
    bytes of its write batches queued and unanswered (module doc).

    A store without certificates authenticates nobody: its callers (INSECURE) are one
    crowd, not principals, and are neither refused nor counted, as before security.
    """

    def __init__(self, queue_bytes_max: int, streams_max: int = STREAMS_PER_PRINCIPAL_MAX) -> None:
        assert queue_bytes_max > 0
        self.queue_bytes_max = int(queue_bytes_max * QUEUE_SHARE_PER_PRINCIPAL)
        self._streams = OpenCalls(streams_max)
        self._queued_bytes: dict[Principal, int] = {}

    def open_stream(self, principal: Principal) -> None:
        """Count a streaming call as it opens, before anything is read of it; raises
        CallerUnproven for an anonymous caller, OverCallerLimit past the limit."""
        if principal.kind is PrincipalKind.ANONYMOUS:
            raise CallerUnproven(
                "a streaming call must show a certificate proof or a token when it opens"
            )
        if not self._streams.open(principal):
            raise OverCallerLimit(
                f"{describe(principal)} holds {self._streams.held(principal)} streaming "
                "calls on this store, the most one caller may (STREAMS_PER_PRINCIPAL_MAX "
                f"{self._streams.calls_max})"
            )

    def close_stream(self, principal: Principal) -> None:
        """The end of a call `open_stream` counted."""
        self._streams.close(principal)

    def streams(self, principal: Principal) -> int:
        return self._streams.held(principal)

    @staticmethod
    def counts(principal: Principal) -> bool:
        """Whether the principal's streams and bytes are counted: an INSECURE one's
        are not (class doc)."""
        return principal.kind is not PrincipalKind.UNAUTHENTICATED_INSECURE

    def take_queue_bytes(self, principal: Principal, payload_bytes: int) -> bool:
        """Whether a batch of `payload_bytes` fits the principal's share of the write
        queue; if so it is counted until `give_queue_bytes`. A batch larger than the
        share passes when the principal has nothing queued, as in the queue itself."""
        if not self.counts(principal) or not payload_bytes:
            # A batch of holes and a bridge carries no payload: nothing to count, and
            # counting it kept an entry of 0 that the give of another batch could drop
            # first (a KeyError in the store's write path: the fault suite's S17 on TLS).
            return True
        queued = self._queued_bytes.get(principal, 0)
        if queued and queued + payload_bytes > self.queue_bytes_max:
            return False
        self._queued_bytes[principal] = queued + payload_bytes
        return True

    def give_queue_bytes(self, principal: Principal, payload_bytes: int) -> None:
        """A batch `take_queue_bytes` counted was answered."""
        if not self.counts(principal) or not payload_bytes:
            return
        left = self._queued_bytes[principal] - payload_bytes
        assert left >= 0
        if left:
            self._queued_bytes[principal] = left
        else:
            del self._queued_bytes[principal]

    def queued_bytes(self, principal: Principal) -> int:
        return self._queued_bytes.get(principal, 0)
