"""What the simulated nodes send each other: one dataclass per request and reply, as
the wire protocol has one message pair per RPC. Short `__str__`s keep traces readable."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from streamengine.client.core.writer import HeartbeatAnswered
from streamengine.master.core.model import Held
from streamengine.protocol.certificate import Certificate
from streamengine.protocol.entry import EntryKind, StoredEntry
from streamengine.protocol.producers import ProducerPosition
from streamengine.segment_store.core.commands import SegmentKey


def show_entries(entries: Sequence[StoredEntry]) -> str:
    if not entries:
        return "[]"
    parts = []
    for e in entries[:4]:
        kind = e.kind
        text = e.payload.decode() if kind == EntryKind.EVENT else EntryKind(kind).name[:2]
        parts.append(f"{e.index}:{text}@{e.epoch}")
    more = f" +{len(entries) - 4}" if len(entries) > 4 else ""
    return "[" + " ".join(parts) + more + "]"


def show_segment(segment: SegmentKey) -> str:
    return f"seg{segment.epoch}"


@dataclass(frozen=True, slots=True)
class Call:
    """A unary request; the answer carries the same id."""

    call_id: int
    request: object

    def __str__(self) -> str:
        return f"#{self.call_id} {self.request}"


@dataclass(frozen=True, slots=True)
class Answer:
    call_id: int
    result: object  # a reply, or the exception the server answered with

    def __str__(self) -> str:
        return f"#{self.call_id} -> {self.result!r}"


# ---- master ----


@dataclass(frozen=True, slots=True)
class WriterHeartbeat:
    stream: str
    client_id: str
    epoch: int
    acked_index: int
    segment_bytes: int
    # The lease secret handed with the lease (`LeaderReply`).
    lease_secret: bytes = field(default=b"", repr=False)
    producer: bool = False
    # The latest epoch the writer was answered with (`SendHeartbeat.seen_epoch`).
    seen_epoch: int | None = None


@dataclass(frozen=True, slots=True)
class LeaderReply:
    """The master's answer to a heartbeat or a roll, with the lease secret when this
    answer is the one that granted the lease (as `WriterHeartbeatReply.lease_secret`)."""

    answer: HeartbeatAnswered
    lease_secret: bytes = field(default=b"", repr=False)


@dataclass(frozen=True, slots=True)
class HoldEnded:
    """The `HoldLease` call a writer held open at the master ended: its process died
    (the kernel resets the connection) or the writer was closed. A message the network
    may delay or lose, as it may a reset; a paused or cut-off writer sends none."""

    stream: str
    client_id: str
    epoch: int
    lease_secret: bytes = field(default=b"", repr=False)


@dataclass(frozen=True, slots=True)
class ReleaseLease:
    stream: str
    client_id: str
    epoch: int
    # The master's signed grant of `epoch` (as every message acting under an epoch).
    grant: bytes = field(default=b"", repr=False)
    lease_secret: bytes = field(default=b"", repr=False)


@dataclass(frozen=True, slots=True)
class RollSegment:
    """The leader asks for the next epoch (answered like a heartbeat that grants)."""

    stream: str
    client_id: str
    epoch: int
    exclude: tuple[str, ...] = ()
    grant: bytes = field(default=b"", repr=False)
    lease_secret: bytes = field(default=b"", repr=False)


@dataclass(frozen=True, slots=True)
class SealSegment:
    stream: str
    segment_epoch: int
    writer_epoch: int
    final_index: int
    client_id: str = ""
    grant: bytes = field(default=b"", repr=False)
    certificate: Certificate | None = None
    lost_from_index: int = 0
    producers: tuple[ProducerPosition, ...] | None = None


@dataclass(frozen=True, slots=True)
class ListSegments:
    stream: str


@dataclass(frozen=True, slots=True)
class ScrubReport:
    """A sealed replica the store's scrub read back: its certificate, or damage."""

    segment: tuple[int, int]
    final_index: int
    certificate: Certificate | None
    detail: str = ""


@dataclass(frozen=True, slots=True)
class RegisterStore:
    """A store's registration, sent by a store whose disk was wiped (a new incarnation)
    at every start until it joined; the answer is the master's `Registered`."""

    store: str
    incarnation: int
    cluster_id: str = ""


@dataclass(frozen=True, slots=True)
class StoreHeartbeat:
    store: str
    # What the store holds: (stream id, epoch) -> (fence, acked, last index, bytes).
    held: tuple[tuple[tuple[int, int], Held], ...] = ()
    scrubbed: tuple[ScrubReport, ...] = ()

    def __str__(self) -> str:
        return f"StoreHeartbeat({self.store}, {len(self.held)} segments)"


@dataclass(frozen=True, slots=True)
class StoreHeartbeatReply:
    """The segments the master wants the store to delete (not a copy-set member of a
    sealed segment, or of a deleted stream), and the replicas to scrub first."""

    deletes: tuple[tuple[int, int], ...]
    scrub_first: tuple[tuple[int, int], ...] = ()


# ---- stores: unary ----


@dataclass(frozen=True, slots=True)
class Seal:
    segment: SegmentKey
    new_epoch: int
    grant: bytes = field(default=b"", repr=False)

    def __str__(self) -> str:
        return f"Seal({show_segment(self.segment)}, {self.new_epoch})"


@dataclass(frozen=True, slots=True)
class Read:
    """Everything held in `from_index..to_index` (0: to the end), for recovery."""

    segment: SegmentKey
    from_index: int
    to_index: int

    def __str__(self) -> str:
        return f"Read({show_segment(self.segment)}, {self.from_index}..{self.to_index or ''})"


@dataclass(frozen=True, slots=True)
class ReadReply:
    entries: tuple[StoredEntry, ...]
    fence: int

    def __str__(self) -> str:
        return f"ReadReply({show_entries(self.entries)}, fence {self.fence})"


@dataclass(frozen=True, slots=True)
class RecoveryWrite:
    segment: SegmentKey
    writer_epoch: int
    acked_index: int
    entries: tuple[StoredEntry, ...]
    grant: bytes = field(default=b"", repr=False)

    def __str__(self) -> str:
        return (
            f"RecoveryWrite({show_segment(self.segment)}, e{self.writer_epoch}, "
            f"acked {self.acked_index}, {show_entries(self.entries)})"
        )


@dataclass(frozen=True, slots=True)
class GetSegmentState:
    segment: SegmentKey


@dataclass(frozen=True, slots=True)
class Digest:
    segment: SegmentKey
    up_to_index: int


@dataclass(frozen=True, slots=True)
class CopySegment:
    """To the target: pull `segment` 1..final_index from `source`, verify, confirm."""

    segment: SegmentKey
    source: str
    final_index: int
    fence: int
    tenant: str = ""
    certificate: Certificate | None = None
    replace_held: bool = False

    def __str__(self) -> str:
        return (
            f"CopySegment({show_segment(self.segment)} from {self.source}, "
            f"final {self.final_index}, fence {self.fence}"
            f"{', replacing what it holds' if self.replace_held else ''})"
        )


@dataclass(frozen=True, slots=True)
class CopyReply:
    entries_copied: int
    digest: bytes
    acked_index: int


@dataclass(frozen=True, slots=True)
class Delete:
    segment: SegmentKey


@dataclass(frozen=True, slots=True)
class Refused:
    """FAILED_PRECONDITION: the store's fence is above the epoch sent."""

    fence: int


@dataclass(frozen=True, slots=True)
class Denied:
    """PERMISSION_DENIED: no valid grant for what was asked (or UNAVAILABLE: none can be
    checked yet). Nothing changed."""

    reason: str


# ---- stores: the Write stream ----


@dataclass(frozen=True, slots=True)
class WriteRequest:
    segment: SegmentKey
    writer_epoch: int
    request_id: int
    acked_index: int
    entries: tuple[StoredEntry, ...]
    # On the first request of a stream only (`SendWrite.grant`).
    grant: bytes = field(default=b"", repr=False)

    def __str__(self) -> str:
        grant = ", granted" if self.grant else ""
        return (
            f"Write({show_segment(self.segment)}, e{self.writer_epoch}, req {self.request_id}, "
            f"acked {self.acked_index}, {show_entries(self.entries)}{grant})"
        )


@dataclass(frozen=True, slots=True)
class WriteReply:
    request_id: int
    busy: bool
    matched_index: int
    acked_index: int
    first_index: int
    last_index: int
