"""The rules of one segment copy (CopySegment) on its target store, with no I/O: the
store's copy client and the simulator both run `CopyOp`, which takes these steps in order.

Theory of operation. A copy creates, or refills in place, a replica of a sealed segment
from a healthy one. No reader of the target may ever see an entry that later changes,
so nothing the copy writes is served before the whole copy is verified:
1. `copy_fence`: the source must hold the segment sealed (fence above the segment's
   epoch) and acked up to the final index. The copy is made under the highest of the
   source's fence, the fence the master asked for and the target's own: never lower.
2. `fence_command`: a seal at that fence, before the first copied batch. From then on
   a delayed write of an old leader is refused. The target's fence is never deleted.
   A refill in place that the master asks to replace what the target holds
   (`replace_held`: its replica is damaged or differs from the certificate) then drops
   every copy the target holds of the segment (`drop_command`), so that reads of the
   refilled copy never pass over an old one (RocksDB would read a damaged block under
   the new copies, and the overwrite rule would keep a copy of a higher epoch);
   otherwise stale copies are overwritten by the overwrite rule.
3. `write_command`, per batch read from the source: written at the copy fence with
   acked index 0, which raises nothing (the target keeps the acked index it had: below
   it its copies were final already).
4. `verify`: the copy must hold what the segment's certificate says (the target reads
   it back and computes its certificate, `verify_certificate`), else `CopyMismatch`, and
   the copy stays unconfirmed (a source whose content differs though every crc is
   valid, a copy of a higher epoch the overwrite rule kept, a store gone wrong): nothing
   new is served from it. A segment sealed before certificates existed has none yet:
   its copy is compared with the source's digest instead (`verify`).
5. `confirm_command`: one last write raising the acked index to the final index,
   refused if the copy lost its fence or an index meanwhile (a delete in between).
"""

from __future__ import annotations

from dataclasses import dataclass

from streamengine.protocol.certificate import Certificate
from streamengine.protocol.entry import PackedEntries
from streamengine.protocol.limits import INDEX_MAX
from streamengine.segment_store.core.commands import (
    Command,
    ConfirmCopyCommand,
    DropCopiesCommand,
    Outcome,
    SealCommand,
    SegmentKey,
    WriteCommand,
    WriteResult,
)
from streamengine.segment_store.core.errors import BadRequest, CopyMismatch, CopyRefused
from streamengine.segment_store.core.reads import DigestInfo
from streamengine.segment_store.core.scrub import ScanResult


@dataclass(frozen=True, slots=True)
class CopyTimeouts:
    """How long the target waits on the source before the copy fails (the master's
    repair retries it later, maybe from another replica)."""

    # Each unary call to the source (state, digest).
    call_ms: int = 30_000
    # The whole read of the segment: up to gigabytes over a busy network.
    read_ms: int = 600_000

    def __post_init__(self) -> None:
        assert 0 < self.call_ms <= self.read_ms, "reading a segment is the longest call"


TIMEOUTS = CopyTimeouts()
# The simulator's virtual-time runs last seconds: the same calls, scaled to them.
SIMULATED_TIMEOUTS = CopyTimeouts(call_ms=500, read_ms=2000)


def check_request(final_index: int, source_address: str) -> None:
    if not source_address:
        raise BadRequest("missing source_address")
    if not 0 < final_index <= INDEX_MAX:
        raise BadRequest(f"final_index {final_index} is not in 1..{INDEX_MAX}")


def copy_fence(
    segment: SegmentKey,
    final_index: int,
    source_fence: int,
    source_acked_index: int,
    requested_fence: int,
    local_fence: int,
) -> int:
    """The fence the copy is made under, once the source can serve it."""
    if source_fence <= segment.epoch:
        raise CopyRefused(f"segment is not sealed on the source (fence {source_fence})")
    if source_acked_index < final_index:
        raise CopyRefused(
            f"source acked index {source_acked_index} is below final index {final_index}"
        )
    fence = max(source_fence, requested_fence, local_fence)
    assert fence > segment.epoch and fence >= local_fence
    return fence


def fence_command(segment: SegmentKey, fence: int, tenant: str = "") -> SealCommand:
    return SealCommand(segment, fence, tenant)


def drop_command(segment: SegmentKey, fence: int) -> DropCopiesCommand:
    return DropCopiesCommand(segment, fence)


def write_command(
    segment: SegmentKey, fence: int, batch: PackedEntries, tenant: str = ""
) -> WriteCommand:
    """A batch copied from the source: at the copy fence, raising no acked index. Raises
    CorruptEntry for a value too short to hold its header (the store checks the rest)."""
    assert len(batch), "an empty batch copies nothing"
    writer_epoch = max(fence, max(batch.heads()[1]))
    return WriteCommand(segment, writer_epoch, 0, batch, tenant)


def verify(segment: SegmentKey, final_index: int, local: DigestInfo, source_digest: bytes) -> None:
    """Raise CopyMismatch unless the copy equals the source up to the final index."""
    assert local.up_to_index == final_index
    if local.digest != source_digest:
        raise CopyMismatch(
            f"copy of {segment.stream_id}/{segment.epoch} does not match the source up to "
            f"{final_index}: left unconfirmed (acked {local.acked_index})"
        )


def verify_certificate(segment: SegmentKey, expected: Certificate, local: ScanResult) -> None:
    """Raise CopyMismatch unless the copy, read back, makes the segment's certificate."""
    name = f"{segment.stream_id}/{segment.epoch}"
    if local.certificate is None:
        raise CopyMismatch(f"copy of {name} read back damaged: {local.detail}")
    if local.certificate == expected:
        return
    differing = next(
        (
            (mine.last_index, theirs.last_index)
            for mine, theirs in zip(local.certificate.chunks, expected.chunks, strict=False)
            if mine != theirs
        ),
        None,
    )
    where = f"first differing chunk ends at {differing}" if differing else "chunking differs"
    raise CopyMismatch(
        f"copy of {name} differs from the segment's certificate ({where}): left unconfirmed"
    )


def confirm_command(segment: SegmentKey, fence: int, final_index: int) -> ConfirmCopyCommand:
    return ConfirmCopyCommand(segment, fence, final_index)


# ---- one copy, step by step ----


@dataclass(frozen=True, slots=True)
class AskSourceState:
    """Ask the source for the segment's fence and acked index: answer `source_state`."""


@dataclass(frozen=True, slots=True)
class Submit:
    """Carry `command` out through the store core (group commit): answer `submitted`."""

    command: Command


@dataclass(frozen=True, slots=True)
class ReadSource:
    """Read `from_index..to_index` from the source: each batch to `source_entries`, then
    `source_read_ended`."""

    from_index: int
    to_index: int


@dataclass(frozen=True, slots=True)
class AskDigests:
    """Digest the segment up to `up_to_index` on the source and locally: answer
    `digests`."""

    up_to_index: int


@dataclass(frozen=True, slots=True)
class ReadBack:
    """Read the copy back up to `final_index` and compute its certificate (the store
    core's `certify`): answer `read_back`."""

    final_index: int


@dataclass(frozen=True, slots=True)
class Finished:
    entries_copied: int
    digest: bytes
    acked_index: int


CopyAction = AskSourceState | Submit | ReadSource | AskDigests | ReadBack | Finished


class CopyOp:
    """One CopySegment on its target, as the steps of the theory of operation above.
    The store's copy client and the simulated store carry its actions out and feed the
    answers back; every refusal is raised (a StoreError), ending the copy."""

    def __init__(
        self,
        segment: SegmentKey,
        source_address: str,
        final_index: int,
        requested_fence: int,
        tenant: str = "",
        certificate: Certificate | None = None,
        replace_held: bool = False,
    ) -> None:
        """`tenant`: the stream's, as the master said, kept with the copy ("": unknown);
        `certificate`: the segment's, which the copy must make (None: compare with the
        source's digest, for a segment certified by nobody yet); `replace_held`: drop
        what the target holds of the segment before copying (a refill in place)."""
        check_request(final_index, source_address)
        if certificate is not None and certificate.final_index != final_index:
            raise BadRequest(
                f"the certificate ends at {certificate.final_index}, not at {final_index}"
            )
        self.segment = segment
        self.tenant = tenant
        self.final_index = final_index
        self.requested_fence = requested_fence
        self.certificate = certificate
        self.replace_held = replace_held
        self.fence = 0
        self.entries_copied = 0
        self._local_digest = b""
        self._step = "start"

    def start(self) -> CopyAction:
        assert self._step == "start"
        self._step = "source-state"
        return AskSourceState()

    def source_state(self, fence: int, acked_index: int, local_fence: int) -> CopyAction:
        """Step 1, then 2: the copy fence, raised locally before anything is copied (and
        the old copies dropped, with `replace_held`)."""
        assert self._step == "source-state"
        self.fence = copy_fence(
            self.segment, self.final_index, fence, acked_index, self.requested_fence, local_fence
        )
        self._step = "fencing"
        return Submit(fence_command(self.segment, self.fence, self.tenant))

    def source_entries(self, batch: PackedEntries) -> CopyAction | None:
        """Step 3, per batch the source sent; raises CorruptEntry as `write_command`."""
        assert self._step == "copying"
        if not len(batch):
            return None
        command = write_command(self.segment, self.fence, batch, self.tenant)
        self.entries_copied += len(batch)
        return Submit(command)

    def source_read_ended(self) -> CopyAction:
        assert self._step == "copying"
        self._step = "digests"
        if self.certificate is not None:
            return ReadBack(self.final_index)
        return AskDigests(self.final_index)

    def read_back(self, local: ScanResult) -> CopyAction:
        """Step 4 against the certificate, then 5."""
        assert self._step == "digests" and self.certificate is not None
        verify_certificate(self.segment, self.certificate, local)
        self._local_digest = self.certificate.root()
        self._step = "confirming"
        return Submit(confirm_command(self.segment, self.fence, self.final_index))

    def digests(self, local: DigestInfo, source_digest: bytes) -> CopyAction:
        """Step 4, then 5: confirmed only once the copy equals the source."""
        assert self._step == "digests"
        verify(self.segment, self.final_index, local, source_digest)
        self._local_digest = local.digest
        self._step = "confirming"
        return Submit(confirm_command(self.segment, self.fence, self.final_index))

    def submitted(self, outcome: Outcome) -> CopyAction | None:
        """A command was carried out (a refused one is raised by the shell)."""
        if self._step == "fencing" and self.replace_held:
            self._step = "dropping"
            return Submit(drop_command(self.segment, self.fence))
        if self._step in ("fencing", "dropping"):
            self._step = "copying"
            return ReadSource(1, self.final_index)
        if self._step == "confirming":
            assert isinstance(outcome, WriteResult) and outcome.acked_index >= self.final_index
            self._step = "finished"
            return Finished(self.entries_copied, self._local_digest, outcome.acked_index)
        assert self._step == "copying", self._step
        return None
