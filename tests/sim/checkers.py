"""The invariants of docs/design.md, checked as the simulated cluster runs.

The world calls each check as the shipped code answers (acks, reads, a store's plans,
the grants it takes, the master's commits) and audits every store's replicas now and
then; the first violation ends the run and names what broke the rule:

1. acked appends: a follower yields strictly increasing sequences, each payload once,
   and never passes an acked sequence it did not yield (prefix consistency while
   faults run; `check_complete` after the liveness phase: everything acked was read;
   a bounded read that ends normally has returned every acked event of its range);
   an append is acked only once every earlier segment is sealed at the master.
   Accepted loss (`seal --accept-loss`): an acked event a follower never yields is
   excused only by a `DataLossError` that follower was told and that covers it (loss is
   always told), and a follower is told one only where the master records a declared
   loss (never where nothing was declared lost). Within a declared range stores may
   serve what differs from what was served before (no reader is handed it).
2. one content per position: the first thing any store served or any follower saw at
   `(epoch, index)` is what everyone sees there forever; a store's acked index never
   goes back (what it served never changes).
3. fencing: no store accepts a write (or a seal) below its fence.
4. sealed segments: the entry at the final index is the BRIDGE; replicas whose acked
   index reached it hold identical entries up to it; no acked index passes it; two
   recoveries never seal one segment at different final indexes.
5. at most two unsealed segments; granted epochs strictly increase, across restarts.
   With masters on etcd (`MasterChecker`, for the whole cluster): never two masters
   serving at once, every commit etcd applies is the active master's, a stream's epoch
   never goes back from one master to the next, and no lease is granted to another
   writer while one of an earlier epoch still runs.
6. bad input is refused and changes nothing (the world injects it and calls
   `unchanged`).
7. every append ends (acked, definitely failed, or in doubt), while its writer runs,
   within the append timeout and `APPEND_END_MS_MAX`: no append hangs, even for a
   leader that no master and too few stores answer.
10. repair: a replica damaged at rest (bit rot) is found by its store's scrub and
    replaced or refilled, and its segment is back to N sound replicas once faults stop.
11. authority: a store writes or seals a segment only under a grant the master issued
    (of the writer's epoch, listing the segment and the store), and never refuses a
    writer the grant the master issued it (checked against the grants the master gave,
    not by verifying signatures again); and it takes nothing a writer sends under a
    token it knows is revoked (no store holds it, no user is told it landed, no
    reader sees it). Numbered as in docs/design.md, whose 8 and 9 the simulator
    checks within the others.
12. certificates: a sealed segment's certificate, once recorded (by its writer with the
    seal, or by W agreeing replicas), never changes and is what every replica that
    reached the bridge holds; a replica is condemned only when it differs from it, and
    a reader reports only a replica that does.
13. retention and trims take only whole sealed segments from the head of a stream (the
    point trimmed through never goes back), and a follower skips acked events only
    where it was told `Trimmed` (and only at a position the master trimmed), from then
    on starting at the first retained sequence it was told.
14. lost replicas: a wiped store joins its cluster as one new incarnation, the one the
    master keeps, with every replica it held before marked lost (or held again), however
    many of its registration answers were lost.
15. producers: an event answered as written is in the stream, and never twice.
16. the read side (`CatalogChecker`): a paged walk of the streams shows each stream
    held throughout it once and in order, none never created or removed before it,
    only what its filters select and its caller may see; descriptions, the status and
    the console show the same, and a status's counts agree with its rows.
"""

from __future__ import annotations

import bisect
import contextlib
import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from streamengine.client.core.subscription import DataLoss
from streamengine.etcd import rpc_pb2
from streamengine.master.core.leadership import Lease
from streamengine.master.core.model import SegmentState
from streamengine.master.etcd import EtcdConfig
from streamengine.master.etcd_metadata import WRITER_KEY
from streamengine.master.metadata import prefix_end
from streamengine.master.state import MasterState
from streamengine.protocol.certificate import Certificate
from streamengine.protocol.entry import CorruptEntry, EntryKind
from streamengine.protocol.grants import Grant
from streamengine.protocol.limits import UNSEALED_SEGMENTS_MAX
from streamengine.protocol.retention import position_trimmed
from streamengine.protocol.sequence import pack_sequence, unpack_sequence
from streamengine.segment_store.core.commands import SegmentKey
from streamengine.segment_store.core.store import SegmentStoreCore

if TYPE_CHECKING:
    from tests.sim.runtime.etcd import MemoryEtcd

INVARIANTS = {
    1: "every acked append is read by every follower exactly once, in order",
    2: "no two readers see different payloads at one sequence",
    3: "a store never accepts a write below its fence",
    4: "replicas of a sealed segment hold identical entries up to the bridge",
    5: "at most 2 unsealed segments; epochs strictly increase",
    6: "bad input is refused and changes nothing",
    7: "every append ends within a bound (its timeout, or its writer losing leadership)",
    10: "sealed segments go back to N good replicas",
    11: "stores change segments only under the master's grants, and take every one",
    12: "a sealed segment's certificate is what its replicas at the bridge hold",
    13: "trims take whole sealed segments from the head; readers are told, never skipped",
    14: "a store never stands for a replica it lost",
    15: "a producer event answered as written is in the stream, and never twice",
    16: "what the master shows of its streams is what it holds, to each caller its own",
    17: "a leader hears of a roll its master owes it while its session is renewed",
    18: "a client waiting on a dial crosses a healed cut within a bound",
    19: "a holder closing a connection is done with it at once, even to a silent peer",
    0: "the cluster converges once faults stop (liveness)",
}

# A writer answers its appends in the step that steps it down, and steps down at the
# step its lease ends (its clock wakes it then); this leaves a tick of room for both.
APPEND_END_MS_MAX = 5


class Violation(AssertionError):
    def __init__(self, invariant: int, message: str) -> None:
        self.invariant = invariant
        self.message = message
        super().__init__(f"invariant {invariant} ({INVARIANTS[invariant]}): {message}")


def _show(kind: int, payload: bytes) -> str:
    return payload.decode() if kind == EntryKind.EVENT else EntryKind(kind).name


@dataclass
class FollowerRecord:
    seen: dict[int, bytes] = field(default_factory=dict)  # sequence -> payload
    by_payload: dict[bytes, int] = field(default_factory=dict)
    last: int = -1
    # Accepted losses it was told, each with whether it runs to the segment's end.
    told_lost: list[tuple[DataLoss, bool]] = field(default_factory=list)
    # The first retained sequence of the latest `Trimmed` it was told: what sorts before
    # is gone for it.
    trimmed_before: int = 0

    def told_gone_at(self, sequence: int) -> bool:
        """Whether it was told `sequence` is gone: lost (accepted) or trimmed away."""
        if sequence < self.trimmed_before:
            return True
        epoch, index = unpack_sequence(sequence)
        for loss, through_end in self.told_lost:
            if through_end and loss.covers(epoch, index):
                return True
            if loss.epoch == epoch and loss.first_index <= index <= loss.last_index:
                return True
        return False


class Checker:
    def __init__(self, stream_id: int, append_timeout_ms: int) -> None:
        self.stream_id = stream_id
        self.append_timeout_ms = append_timeout_ms
        # (epoch, index) -> (kind, payload): what was first served or seen there.
        self.truth: dict[tuple[int, int], tuple[int, bytes]] = {}
        self.store_acked: dict[tuple[str, SegmentKey], int] = {}
        self.acked: dict[int, bytes] = {}  # user-acked sequence -> payload
        self.acked_sequences: list[int] = []  # sorted
        self.followers: dict[str, FollowerRecord] = {}
        self.finals: dict[SegmentKey, int] = {}
        self.certificates: dict[SegmentKey, Certificate] = {}
        # (store, segment) replicas the world forged behind their store's back (damage
        # at rest, `SimConfig.rot`): what they hold is not what they served, and no
        # reader may ever get it.
        self.rotted: set[tuple[str, SegmentKey]] = set()
        self.failed: set[bytes] = set()  # appends users were told definitely failed
        # Events sent under a token every store knew was revoked: none may be taken.
        self.revoked: set[bytes] = set()
        # Producer events answered as in the stream at a sequence no longer known (0):
        # followers must read each of them by the end (invariant 15).
        self.answered_written: set[bytes] = set()
        self.served_payloads: set[bytes] = set()
        self.epoch_seen = 0
        self.checks = 0
        # Acked entries lost by stores running with fsync never, as they restarted.
        self.unsynced_losses: list[str] = []
        # Indexes a store with fsync never held (its matched prefix) and lost as it
        # restarted, by (store, segment): (first, last), until written to it again. A
        # user ack of one, before or after the restart, counted the store's answer to a
        # write it never synced: an acked entry lost.
        self.unsynced_gaps: dict[tuple[str, SegmentKey], tuple[int, int]] = {}
        # Invariant 7: appends not yet ended, per writer (client id), and when each
        # writer's leadership ended.
        # Per writer, appends not ended yet: payload -> when it started (the writer's
        # clock), oldest first.
        self.open_appends: dict[str, dict[bytes, int]] = {}
        # Invariant 11: every grant the master gave, by epoch (renewals may list fewer
        # unsealed segments than the first answer of an epoch did).
        self.grants: dict[int, list[Grant]] = {}
        # Segments sealed accepting loss: the first index the master records as lost.
        self.declared_lost: dict[SegmentKey, int] = {}
        # Invariant 13: the epoch the master trimmed the stream through.
        self.trimmed_through = 0
        # The operator deleted the stream and could not undelete it within its grace:
        # the master removed it, and every event with it, as asked (`stream_removed`).
        self.removed = False

    # ---- invariant 2 (and 4) on stores ----

    def _agree(
        self, where: str, epoch: int, index: int, kind: int, payload: bytes, reader: bool = False
    ) -> None:
        if not reader and self._in_declared_loss(epoch, index):
            return  # declared lost: no reader is handed what a store holds there
        first = self.truth.setdefault((epoch, index), (kind, payload))
        if first != (kind, payload):
            raise Violation(
                2,
                f"{where} has {_show(kind, payload)} at epoch {epoch} index {index}; "
                f"{_show(*first)} was served there before",
            )
        if kind == EntryKind.EVENT:
            if payload in self.failed:
                raise Violation(1, f"{where} has {payload!r}, an append reported as failed")
            if payload in self.revoked:
                raise Violation(
                    11, f"{where} has {payload!r}, sent under a token the stores knew revoked"
                )
            self.served_payloads.add(payload)

    def sent_under_revoked_token(self, payloads: tuple[bytes, ...]) -> None:
        """A writer sent these under a token every store knew was revoked (when the
        append started): no store may take them, no user be told they landed, and no
        reader ever see them."""
        for payload in payloads:
            if payload in self.served_payloads:
                raise Violation(11, f"{payload!r} was served before it was sent")
            self.revoked.add(payload)

    def appends_failed(self, payloads: list[bytes]) -> None:
        """A writer stepped down and told users these appends definitely failed (they
        were never sent): no reader may ever see them."""
        for payload in payloads:
            if payload in self.served_payloads:
                raise Violation(1, f"{payload!r} was reported failed but was served")
            self.failed.add(payload)

    def audit(
        self,
        stores: dict[str, SegmentStoreCore],
        state: MasterState,
        held_by_store: Mapping[str, set[SegmentKey]] | None = None,
    ) -> None:
        """Everything again, from scratch: every store's served prefix of every segment
        against what was served before, sealed replicas against each other, the master's
        unsealed count. Catches a change the incremental checks were not told of. Only
        this checker's stream: the stores may hold others (one checker each), and
        `held_by_store` may name what each holds of this stream alone (a world of many
        streams sorts their segments by stream once, not once per stream)."""
        for name, core in sorted(stores.items()):
            if held_by_store is None:
                held = set(core.catalog.segments())
            else:
                held = held_by_store.get(name, set())
            for store, segment in sorted(self.store_acked):
                if store == name and segment not in held:
                    self.store_deleted(name, segment)  # gone since: a later copy starts anew
            for segment in sorted(held):
                if segment.stream_id != self.stream_id:
                    continue
                if (name, segment) in self.rotted:
                    continue  # damaged at rest on purpose
                meta = core.catalog.meta(segment)
                assert meta is not None
                if not meta.acked_index <= meta.matched_index <= meta.last_index:
                    raise Violation(2, f"store {name} {segment}: {meta}")
                if meta.acked_index < self.store_acked.get((name, segment), 0):
                    raise Violation(2, f"store {name} {segment}: acked went back")
                served = core.reader.read(segment, 1, meta.acked_index) if meta.acked_index else []
                for e in served:
                    self._agree(f"store {name} (audit)", segment.epoch, e.index, e.kind, e.payload)
                final = self.finals.get(segment)
                if final is not None and meta.acked_index >= final:
                    self.replica_complete(name, core, segment, final)
        self.master_changed(state)

    def store_deleted(self, store: str, segment: SegmentKey) -> None:
        """The master had `store` delete its copy of `segment` (repair swapped it out,
        or it was never a member): what it served stays true; a later copy starts anew."""
        self.checks += 1
        self.store_acked.pop((store, segment), None)
        self.rotted.discard((store, segment))
        self.unsynced_gaps.pop((store, segment), None)

    def identity_lost(self, store: str) -> None:
        """`store`, running with fsync never, lost in a power cut the cluster id it had
        kept: the master takes it for a new disk and every replica it held for lost,
        which may leave segments below R. The documented loss of fsync never, as a lost
        acked write is (the runtime world's seed 5009)."""
        self.unsynced_losses.append(
            f"store {store} lost the cluster id it kept (fsync never): its replicas count "
            "as lost"
        )

    def store_wiped(self, store: str) -> None:
        """`store` restarted with an empty disk (a new incarnation): it serves nothing
        of what it served before; what it served stays true for everyone else."""
        self.checks += 1
        for name, segment in sorted(self.store_acked):
            if name == store:
                del self.store_acked[(name, segment)]
        self.rotted = {(name, segment) for name, segment in self.rotted if name != store}
        for name, segment in sorted(self.unsynced_gaps):
            if name == store:
                del self.unsynced_gaps[(name, segment)]

    def store_restarted(
        self,
        store: str,
        core: SegmentStoreCore,
        fsync_never: bool,
        matched_before: Mapping[SegmentKey, int],
        served_before: Mapping[SegmentKey, frozenset[int]] | None = None,
    ) -> None:
        """A store restarts with exactly what it had acked, unless it runs with fsync
        never: then losing unsynced writes is the documented loss (DESIGN: unsafe),
        counted, and what it holds now is what it serves from here on. That loss counts
        also when the store's own acked index survived but entries a writer acked on its
        answers did not (`matched_before`: its matched index per segment at the crash),
        and when a copy it held as served gave way to an older one it had synced
        (`served_before`, `served_copies` at the crash: a recovery's bridge over a
        stale event, lost, then that event raised to acked on the recovery's word,
        simulator seed 16769)."""
        if fsync_never:
            self._record_unsynced_gaps(store, core, matched_before)
            self._record_unsynced_overwrites(store, core, served_before or {})
        for (name, segment), acked in sorted(self.store_acked.items()):
            meta = core.catalog.meta(segment) if name == store else None
            if name == store and (meta is None or meta.acked_index != acked):
                if not fsync_never:
                    raise Violation(
                        2, f"store {store} restarted with {meta} for {segment} ({acked})"
                    )
                self.unsynced_losses.append(
                    f"store {store} lost {segment} acked {acked} -> "
                    f"{meta.acked_index if meta else 'nothing'} (fsync never)"
                )
                self.store_acked[(name, segment)] = meta.acked_index if meta else 0

    def _record_unsynced_gaps(
        self, store: str, core: SegmentStoreCore, matched_before: Mapping[SegmentKey, int]
    ) -> None:
        for segment, before in sorted(matched_before.items()):
            meta = core.catalog.meta(segment)
            after = meta.matched_index if meta else 0
            if after >= before or segment.stream_id != self.stream_id:
                continue
            _, last = self.unsynced_gaps.get((store, segment), (0, 0))
            self.unsynced_gaps[(store, segment)] = (after + 1, max(before, last))
            low = pack_sequence(segment.epoch, after + 1)
            high = pack_sequence(segment.epoch, before)
            lo = bisect.bisect_left(self.acked_sequences, low)
            hi = bisect.bisect_right(self.acked_sequences, high)
            if lo < hi:
                _, index = unpack_sequence(self.acked_sequences[lo])
                self._unsynced_ack(store, segment.epoch, index)
                continue
            # Acked by the cluster, its writer gone before it told its user: a follower
            # read it, so it was acked all the same (the runtime world's seed 1126).
            served = [
                sequence
                for record in self.followers.values()
                for sequence in record.seen
                if low <= sequence <= high
            ]
            if served:
                _, index = unpack_sequence(min(served))
                self._unsynced_ack(store, segment.epoch, index)

    def served_copies(
        self, core: SegmentStoreCore, segments: Iterable[SegmentKey] | None = None
    ) -> dict[SegmentKey, frozenset[int]]:
        """Per segment of this stream (of `segments`, when the caller sorted a store's
        by stream once), the indexes where `core` holds the copy that was served there
        (before a crash: `store_restarted`'s `served_before`)."""
        held: dict[SegmentKey, frozenset[int]] = {}
        for segment in sorted(core.catalog.segments() if segments is None else segments):
            meta = core.catalog.meta(segment)
            if segment.stream_id != self.stream_id or meta is None or not meta.last_index:
                continue
            held[segment] = frozenset(
                index
                for index, copy in sound_copies(core, segment, meta.last_index).items()
                if self.truth.get((segment.epoch, index)) == copy
            )
        return held

    def _record_unsynced_overwrites(
        self,
        store: str,
        core: SegmentStoreCore,
        served_before: Mapping[SegmentKey, frozenset[int]],
    ) -> None:
        for segment, indexes in sorted(served_before.items()):
            meta = core.catalog.meta(segment)
            if not indexes or meta is None:
                continue  # a segment gone whole is judged by its acked index
            now = sound_copies(core, segment, max(indexes))
            for index in sorted(indexes):
                if index in now and now[index] != self.truth[(segment.epoch, index)]:
                    self.unsynced_losses.append(
                        f"store {store} lost its copy of {segment.epoch}/{index} that was "
                        "served, an older one it had synced under it (fsync never)"
                    )
                    break

    def _unsynced_ack(self, store: str, epoch: int, index: int) -> None:
        self.unsynced_losses.append(
            f"store {store} lost {epoch}/{index}, acked on its answer to a write it never "
            "synced (fsync never)"
        )

    # ---- invariant 3 ----

    def write_attempted(
        self, store: str, segment: SegmentKey, epoch: int, fence_before: int, accepted: bool
    ) -> None:
        if accepted and epoch < fence_before:
            raise Violation(
                3, f"store {store} accepted epoch {epoch} on {segment} fenced at {fence_before}"
            )

    # ---- invariant 4 ----

    def sealed_at_master(
        self, segment: SegmentKey, final: int, stores: dict[str, SegmentStoreCore]
    ) -> None:
        known = self.finals.get(segment)
        if known is not None and known != final:
            raise Violation(4, f"segment {segment.epoch} sealed at {known}, then at {final}")
        self.finals[segment] = final
        for name, core in sorted(stores.items()):
            meta = core.catalog.meta(segment)
            if meta is not None and meta.acked_index > final:
                raise Violation(
                    4,
                    f"store {name}: segment {segment.stream_id}/{segment.epoch} acked "
                    f"{meta.acked_index} passes bridge {final}",
                )
            if (
                meta is not None
                and meta.acked_index == final
                and (name, segment) not in self.rotted
            ):
                self.replica_complete(name, core, segment, final)

    def replica_complete(
        self, store: str, core: SegmentStoreCore, segment: SegmentKey, final: int
    ) -> None:
        held = core.reader.read(segment, 1, final)
        if len(held) != final or held[-1].kind != EntryKind.BRIDGE:
            raise Violation(4, f"store {store}: segment {segment.epoch} lacks its bridge {final}")
        for e in held:
            if e.kind == EntryKind.BRIDGE and e.index != final:
                raise Violation(4, f"store {store}: a BRIDGE at {e.index} below {final}")
            self._agree(f"sealed replica {store}", segment.epoch, e.index, e.kind, e.payload)

    # ---- invariant 12 ----

    def certificate_recorded(
        self, segment: SegmentKey, certificate: Certificate, stores: dict[str, SegmentStoreCore]
    ) -> None:
        """The master recorded `certificate` for `segment`: it never changes, and every
        replica sealed and acked up to its bridge holds exactly that content."""
        known = self.certificates.setdefault(segment, certificate)
        if known != certificate:
            raise Violation(
                12,
                f"segment {segment.epoch}: certificate {certificate.describe()} replaced "
                f"{known.describe()}",
            )
        for name, core in sorted(stores.items()):
            if (name, segment) in self.rotted:
                continue  # it differs, on purpose: the scrub condemns it
            meta = core.catalog.meta(segment)
            reached = meta is not None and meta.acked_index >= certificate.final_index
            if reached and meta is not None and meta.fence > segment.epoch:
                held = core.reader.certify(segment, certificate.final_index).certificate
                if held != certificate:
                    raise Violation(
                        12,
                        f"store {name}: segment {segment.epoch} at its bridge differs "
                        f"from its certificate {certificate.describe()}",
                    )

    def replica_condemned(
        self,
        store: str,
        core: SegmentStoreCore | None,
        segment: SegmentKey,
        certificate: Certificate,
    ) -> None:
        """The master judged `store`'s replica bad: it must differ from the certificate."""
        if core is None or core.catalog.meta(segment) is None:
            return  # nothing held any more: nothing was condemned wrongly
        if (store, segment) in self.rotted:
            return  # rightly: it was forged
        held = core.reader.certify(segment, certificate.final_index).certificate
        if held == certificate:
            raise Violation(
                12,
                f"store {store}: segment {segment.epoch} condemned though it holds its "
                f"certificate {certificate.describe()}",
            )

    def reader_reported(self, reader: str, store: str, segment: SegmentKey, problem: str) -> None:
        """A reader found `store`'s replica of `segment` serving what differs from the
        certificate: only a forged one may."""
        if (store, segment) not in self.rotted:
            raise Violation(
                12, f"{reader}: {store} reported for segment {segment.epoch}: {problem}"
            )

    # ---- invariant 5 ----

    def master_changed(self, state: MasterState, granted_epoch: int = 0) -> None:
        self.checks += 1
        if granted_epoch:
            if granted_epoch <= self.epoch_seen:
                raise Violation(5, f"granted epoch {granted_epoch} after {self.epoch_seen}")
            self.epoch_seen = granted_epoch
        unsealed = state.unsealed(self.stream_id)
        if len(unsealed) > UNSEALED_SEGMENTS_MAX:
            raise Violation(5, f"unsealed segments {[s.epoch for s in unsealed]}")
        # This checker's stream only: other streams' epochs say nothing of its own.
        name = state.names.get(self.stream_id)
        record = state.streams.get(name) if name is not None else None
        if record is not None and record.epoch < self.epoch_seen:
            raise Violation(5, f"stream epoch {record.epoch} after {self.epoch_seen}")
        self._trims_at_master(state)

    # ---- invariant 13 ----

    def _trims_at_master(self, state: MasterState) -> None:
        """Only whole sealed segments from the head are trimmed, and what was trimmed
        stays trimmed."""
        name = state.names.get(self.stream_id)
        record = state.streams.get(name) if name is not None else None
        if record is None:
            return
        through = record.trimmed_through_epoch
        if through < self.trimmed_through:
            raise Violation(13, f"trimmed through epoch {through} after {self.trimmed_through}")
        self.trimmed_through = through
        for segment in state.stream_segments(self.stream_id):
            trimmed = bool(segment.removal_at_ms)
            if trimmed != (segment.epoch <= through):
                raise Violation(
                    13,
                    f"segment {segment.epoch} {'is' if trimmed else 'is not'} trimmed; the "
                    f"stream is trimmed through epoch {through}",
                )
            if trimmed and segment.state != SegmentState.SEALED:
                raise Violation(13, f"segment {segment.epoch} trimmed, {segment.state.name}")

    def trim_told(
        self, follower: str, position: int, first_retained: int, state: MasterState | None
    ) -> None:
        """`follower` at `position` was told `Trimmed` with `first_retained`: only at a
        position the master trimmed away (`state`: what it serves from now, None while
        none serves); what sorts before `first_retained` is gone for it from now on."""
        self.checks += 1
        if state is not None:
            self._trims_at_master(state)
        if state is not None and not position_trimmed(position, self.trimmed_through):
            epoch, index = unpack_sequence(position)
            raise Violation(
                13,
                f"follower {follower} told {epoch}/{index} was trimmed; the master trimmed "
                f"through epoch {self.trimmed_through}",
            )
        record = self.followers.setdefault(follower, FollowerRecord())
        record.trimmed_before = max(record.trimmed_before, first_retained)

    # ---- invariant 11 ----

    def grant_issued(self, grant: Grant) -> None:
        issued = self.grants.setdefault(grant.epoch, [])
        if grant not in issued:
            issued.append(grant)

    def _issued_for(self, store: str, segment: SegmentKey, epoch: int) -> bool:
        return any(
            grant.stream_id == segment.stream_id
            and (listed := grant.segment(segment.epoch)) is not None
            and store in listed.copy_set
            for grant in self.grants.get(epoch, ())
        )

    def change_granted(self, store: str, segment: SegmentKey, epoch: int) -> None:
        """`store` accepted a write or seal of `segment` under `epoch`."""
        self.checks += 1
        if not self._issued_for(store, segment, epoch):
            raise Violation(
                11,
                f"store {store} changed segment {segment.epoch} under epoch {epoch}: the "
                "master granted no such thing",
            )

    # ---- invariant 7 ----

    def append_started(self, writer: str, payloads: tuple[bytes, ...], clock_ms: int) -> None:
        started = self.open_appends.setdefault(writer, {})
        for payload in payloads:
            started[payload] = clock_ms

    def append_ended(self, writer: str, payloads: list[bytes] | tuple[bytes, ...]) -> None:
        started = self.open_appends.get(writer, {})
        for payload in payloads:
            started.pop(payload, None)

    def writer_gone(self, writer: str) -> None:
        """The process crashed: nobody is left to answer (or wait for) its appends."""
        self.open_appends.pop(writer, None)

    def writer_running(self, writer: str, clock_ms: int) -> None:
        """A writer process that runs (up, not paused) at `clock_ms` of its own clock."""
        started = self.open_appends.get(writer)
        if not started:
            return
        payload, started_ms = next(iter(started.items()))
        if clock_ms > started_ms + self.append_timeout_ms + APPEND_END_MS_MAX:
            raise Violation(
                7,
                f"{writer}: an append started at {started_ms} is still open at {clock_ms}: "
                f"{payload!r}",
            )

    # ---- invariant 1 (and 2 on readers) ----

    def user_acked(
        self, epoch: int, index: int, payload: bytes, state: MasterState | None
    ) -> None:
        """A user was told `payload` landed at `epoch`/`index`; `state`: what the
        master serves from now (None while no master serves: the gate goes unchecked)."""
        self.checks += 1
        segments = state.stream_segments(self.stream_id) if state is not None else []
        earlier = [
            s.epoch for s in segments if s.epoch < epoch and s.state != SegmentState.SEALED
        ]
        if earlier:
            raise Violation(1, f"acked {epoch}/{index} while segments {earlier} are unsealed")
        sequence = pack_sequence(epoch, index)
        if sequence in self.acked:
            raise Violation(1, f"sequence {epoch}/{index} acked twice")
        self._agree("a user ack", epoch, index, EntryKind.EVENT, payload)
        self.acked[sequence] = payload
        bisect.insort(self.acked_sequences, sequence)
        for (store, segment), (first, last) in sorted(self.unsynced_gaps.items()):
            if segment.epoch == epoch and first <= index <= last:
                self._unsynced_ack(store, epoch, index)
        for name, follower in sorted(self.followers.items()):
            if (
                follower.last > sequence
                and sequence not in follower.seen
                and not follower.told_gone_at(sequence)
            ):
                raise Violation(1, f"follower {name} passed acked {epoch}/{index} without it")

    def follower_event(self, follower: str, sequence: int, payload: bytes) -> None:
        self.checks += 1
        record = self.followers.setdefault(follower, FollowerRecord())
        epoch, index = unpack_sequence(sequence)
        if sequence <= record.last:
            raise Violation(1, f"follower {follower} yields {epoch}/{index} after {record.last}")
        if payload in record.by_payload:
            again = unpack_sequence(record.by_payload[payload])
            # Every payload is appended once, but a producer's (`p:NODE:SEQUENCE`), which
            # its process resends after every writer change until acked: one of those in
            # the stream twice is exactly once broken (issue #40).
            invariant = 15 if payload.startswith(b"p:") else 1
            raise Violation(
                invariant, f"follower {follower}: {payload!r} at {again} and {epoch}/{index}"
            )
        self._agree(f"follower {follower}", epoch, index, EntryKind.EVENT, payload, reader=True)
        for (store, segment), (first, last) in sorted(self.unsynced_gaps.items()):
            if segment.epoch == epoch and first <= index <= last:
                self._unsynced_ack(store, epoch, index)  # served: acked, if never told
        lo = bisect.bisect_right(self.acked_sequences, record.last)
        hi = bisect.bisect_left(self.acked_sequences, sequence)
        for skipped in self.acked_sequences[lo:hi]:
            if not record.told_gone_at(skipped):
                missed = unpack_sequence(skipped)
                raise Violation(1, f"follower {follower} skipped acked {missed}, told no loss")
        record.seen[sequence] = payload
        record.by_payload[payload] = sequence
        record.last = sequence

    def stream_removed(self) -> None:
        """The operator's undelete came after the grace: the master answered that the
        stream no longer exists. Its acked events are a loss the operator asked for, so
        no follower is owed the ones it had not read, nor is a producer's answered
        event owed to a reader; what was read or served must still agree."""
        self.checks += 1
        self.removed = True

    def missing(self, follower: str) -> list[int]:
        """Acked events `follower` has not read and was told no loss of (none once the
        operator let the stream go: `stream_removed`)."""
        if self.removed:
            return []
        record = self.followers.setdefault(follower, FollowerRecord())
        return [
            s for s in self.acked_sequences if s not in record.seen and not record.told_gone_at(s)
        ]

    def bounded_read_finished(self, reader: str, end: int) -> None:
        """`reader` read `[0, end)` and ended normally: never a short answer, every
        acked event of the range is among what it yielded (issue #36)."""
        self.checks += 1
        record = self.followers.setdefault(reader, FollowerRecord())
        in_range = self.acked_sequences[: bisect.bisect_left(self.acked_sequences, end)]
        missed = [s for s in in_range if s not in record.seen and not record.told_gone_at(s)]
        if missed:
            raise Violation(
                1,
                f"bounded read {reader} ended without {len(missed)} acked events of its "
                f"range, the first {unpack_sequence(missed[0])}",
            )

    # ---- accepted loss (invariant 1's converse: loss is always told) ----

    def loss_declared(self, segment: SegmentKey, lost_from: int) -> None:
        """The master sealed `segment` recording `lost_from..` as lost."""
        self.checks += 1
        known = self.declared_lost.setdefault(segment, lost_from)
        if known != lost_from:
            raise Violation(
                4, f"segment {segment.epoch}: loss declared from {known}, then {lost_from}"
            )

    def _in_declared_loss(self, epoch: int, index: int) -> bool:
        lost_from = self.declared_lost.get(SegmentKey(self.stream_id, epoch))
        return lost_from is not None and index >= lost_from

    def loss_told(
        self, follower: str, segment: SegmentKey, loss: DataLoss, through_end: bool
    ) -> None:
        """`follower` was told `DataLossError` for `loss` (accepted): only where the
        master declared it; the acked events it covers are excused from then on."""
        self.checks += 1
        declared = self.declared_lost.get(segment)
        if declared is None or loss.first_index < declared:
            raise Violation(
                1,
                f"follower {follower} told {loss}, where the master declared "
                + (f"loss from {declared}" if declared else "nothing lost"),
            )
        self.followers.setdefault(follower, FollowerRecord()).told_lost.append((loss, through_end))

    def check_complete(self, followers: list[str], acked: frozenset[int] | None = None) -> None:
        """Every follower read every acked event (of `acked` when given: those acked
        when the run converged, as later ones may still be on their way), and every
        producer event answered as written was read."""
        for name in followers:
            missing = [s for s in self.missing(name) if acked is None or s in acked]
            if missing:
                raise Violation(1, f"follower {name} never read {unpack_sequence(missing[0])}")
        if self.removed:
            return
        read = {p for name in followers for p in self.followers[name].by_payload}
        for payload in sorted(self.answered_written - read):
            raise Violation(15, f"{payload!r} was answered as in the stream and never read")

    def producer_answered_written(self, payload: bytes) -> None:
        """A producer's retry was answered that `payload` is in the stream, at a sequence
        the table no longer knows (0)."""
        self.answered_written.add(payload)


class MasterChecker:
    """Invariant 5 across masters on etcd, for the whole cluster: what the masters
    serving say, looked at now and then (`look`), and every transaction etcd applies
    (`commit_applied`, a `SimEtcd.txn_observers` entry).

    `sees_every_release`: looked at often enough that no lease is released and granted
    to another between two looks (a few streams looked at every few ms). Only then is a
    lease granted while an earlier one seemed to run a violation; looked at less often,
    a release in between is as likely."""

    def __init__(self, etcd: EtcdConfig | None = None, sees_every_release: bool = False) -> None:
        self.etcd = etcd  # None: one master, without etcd
        self.sees_every_release = sees_every_release
        # The latest epoch any master serving had, per stream.
        self.latest_epoch: dict[str, int] = {}
        # Per stream, the longest any master let each (epoch, holder) granted run.
        self.leases: dict[str, dict[tuple[int, str], int]] = {}
        self.serving: list[str] = []  # the masters serving in turn
        self.commits = 0
        # Per stream, the latest epoch seen served before the master lost its metadata:
        # none of them is ever granted again, to anyone.
        self.granted_before_rebuild: dict[str, int] = {}
        # Per stream and holder, the digest of the secret its leases were granted with:
        # a writer shows the one secret it drew all its life, so a lease granted to it
        # anew with another was granted to nobody that could learn it (its own earlier
        # grant's answer lost, an epoch spent: issue #38's stuttering master).
        self.holder_secrets: dict[tuple[str, str], bytes] = {}

    def look(self, active: list[str], state: MasterState | None, lease_ms: int) -> None:
        """`active`: the masters that would serve now; `state`: what the one serves."""
        if len(active) > 1:
            raise Violation(5, f"two masters serve at once: {active}")
        if not active or state is None:
            return
        if not self.serving or self.serving[-1] != active[0]:
            self.serving.append(active[0])
        for stream, lease in sorted(state.leases.items()):
            if lease.epoch:
                self._lease_seen(stream, lease, lease_ms)

    def rebuilt(self, used: Mapping[str, int]) -> None:
        """The master rebuilt its metadata from the stores, knowing each stream's
        epochs only as far as any store saw them (`used`: a segment's or a fence's; it
        grants from `rebuild.REBUILD_EPOCH_GAP` past that, docs/design.md, rebuilding
        the metadata). From here on a stream's epochs are held to what the stores saw."""
        self.latest_epoch = {stream: used[stream] for stream in sorted(used)}
        self.leases.clear()

    def _lease_seen(self, stream: str, lease: Lease, lease_ms: int) -> None:
        latest = self.latest_epoch.get(stream, 0)
        if lease.epoch < latest:
            raise Violation(5, f"{stream}: epoch {lease.epoch} served after {latest}")
        self.latest_epoch[stream] = lease.epoch
        leases = self.leases.setdefault(stream, {})
        if not lease.holder:
            # Released: the holder of that epoch holds it no longer.
            for epoch, holder in leases:
                if epoch == lease.epoch:
                    leases[epoch, holder] = min(leases[epoch, holder], lease.expires_ms)
            return
        key = (lease.epoch, lease.holder)
        known = self.holder_secrets.setdefault((stream, lease.holder), lease.secret_sha256)
        if known != lease.secret_sha256:
            raise Violation(
                5,
                f"{stream}: epoch {lease.epoch} granted to {lease.holder} with another "
                "secret than its earlier lease's: that writer could not learn it",
            )
        lost_latest = self.granted_before_rebuild.get(stream, 0)
        if key not in leases and lease.epoch <= lost_latest:
            raise Violation(
                5,
                f"{stream}: epoch {lease.epoch} granted to {lease.holder} after a rebuild, "
                f"though the master that lost its metadata served up to epoch {lost_latest}",
            )
        if key not in leases and self.sees_every_release:
            granted_ms = lease.expires_ms - lease_ms
            for (epoch, holder), expires_ms in leases.items():
                if holder != lease.holder and expires_ms > granted_ms:
                    raise Violation(
                        5,
                        f"{stream}: epoch {lease.epoch} granted to {lease.holder} while "
                        f"epoch {epoch} of {holder} ran until {expires_ms}",
                    )
        # The longest any master let it run: a master taking over must honour it.
        leases[key] = max(leases.get(key, 0), lease.expires_ms)

    def commit_applied(
        self, data: MemoryEtcd, request: rpc_pb2.TxnRequest, reply: rpc_pb2.TxnResponse
    ) -> None:
        """A master's commit landed only while it was the active one: the writer key it
        puts (`etcd_metadata`: the committer's election key) names the oldest election
        key."""
        assert self.etcd is not None, "commits to an etcd, from masters on none"
        puts = [op.request_put for op in request.success if op.HasField("request_put")]
        writer_key = self.etcd.prefix + WRITER_KEY
        committer = [put.value for put in puts if put.key == writer_key]
        if not reply.succeeded or not committer:
            return
        election = self.etcd.election_name + b"/"
        oldest = data.range(
            rpc_pb2.RangeRequest(
                key=election,
                range_end=prefix_end(election),
                sort_target=rpc_pb2.RangeRequest.CREATE,
                limit=1,
            )
        ).kvs
        if not oldest or committer[0] != oldest[0].key:
            raise Violation(
                5,
                f"a commit of {committer[0]!r} landed while "
                f"{oldest[0].key if oldest else 'no key'!r} was the oldest",
            )
        self.commits += 1


@dataclass(frozen=True, slots=True)
class StreamsLook:
    """The streams the serving master held at one moment, by name with their ids."""

    index: int
    wall_ms: int
    ids: Mapping[str, int]


@dataclass(frozen=True, slots=True)
class Shown:
    """Streams one read-side answer showed: which caller asked with which filters."""

    what: str
    names: Sequence[str]  # in the order shown
    ids: Mapping[str, int]  # the stream ids shown, where the answer has them
    tenant: str = ""  # the tenant filter the answer obeys ("" for none)
    prefix: str = ""  # the name prefix it obeys
    # The tenant the caller's token is of ("" for a cluster admin): it sees no other.
    caller_tenant: str = ""
    in_order: bool = True  # each name once, ascending (a paged walk, the rows)
    complete: bool = True  # every stream that held throughout is among them
    name: str = ""  # the one stream asked for (a description), "" for any

    def selects(self, name: str) -> bool:
        scopes = [scope for scope in (self.tenant, self.caller_tenant) if scope]
        return (
            name.startswith(self.prefix)
            and all(name.startswith(f"{s}/") for s in scopes)
            and (not self.name or name == self.name)
        )


class CatalogChecker:
    """Invariant 16: what the master shows of its streams (ListStreams walked a page at
    a time, DescribeStream, GetClusterStatus, the console) is what it holds, held to
    the streams the serving master's state held as the world looked at it (`look`)
    before and after each answer (docs/design.md, "Many streams": a page starts after
    the last name of the one before, so streams created or removed in between never
    shift a page):

    - a walk shows names in ascending order, each once, every one selected by its
      filters and visible to its caller (a tenant's token: its own tenant's only), and
      every stream that was held both before and after the walk;
    - nothing shown was never created, nor removed before the answer began, and a name
      shows the stream id the master gave it;
    - the world never names a stream again once removed, so a stream held at two looks
      was held in between, and one that comes back after a look missed it is a
      violation.

    An answer is judged once a look after it exists (`after` in `judge`: the master may
    not be serving then)."""

    def __init__(self) -> None:
        self.looks: list[StreamsLook] = []
        # Names the world asked to create, and the stream ids the master gave them.
        self.asked: set[str] = set()
        self.ids: dict[str, int] = {}
        # The first look that missed a name an earlier one held: removed from then on.
        self.gone: dict[str, int] = {}
        self.judged = 0
        self._waiting: list[tuple[int, Shown]] = []

    def asked_to_create(self, name: str) -> None:
        self.asked.add(name)

    def look(self, wall_ms: int, state: MasterState) -> StreamsLook:
        ids = {name: record.stream_id for name, record in state.streams.items()}
        index = len(self.looks)
        look = StreamsLook(index, wall_ms, ids)
        for name, stream_id in sorted(ids.items()):
            if name in self.gone:
                raise Violation(16, f"{name} held again after look {self.gone[name]} missed it")
            if name not in self.asked:
                raise Violation(16, f"the master holds {name}, which nobody created")
            known = self.ids.setdefault(name, stream_id)
            if known != stream_id:
                raise Violation(16, f"{name} is stream {stream_id}, after {known}")
        if self.looks:
            for name in sorted(set(self.looks[-1].ids) - set(ids)):
                self.gone[name] = index
        self.looks.append(look)
        waiting, self._waiting = self._waiting, []
        for before, shown in waiting:
            self.judge(shown, before, index)
        return look

    def last_look(self, before_ms: int | None = None) -> int | None:
        """The latest look (taken strictly before `before_ms`, when given)."""
        for look in reversed(self.looks):
            if before_ms is None or look.wall_ms < before_ms:
                return look.index
        return None

    def first_look_after(self, after_ms: int) -> int | None:
        for look in self.looks:
            if look.wall_ms > after_ms:
                return look.index
        return None

    def shown(self, shown: Shown, before: int | None, after: int | None) -> None:
        """An answer given between looks `before` and `after` (None: no look before it
        yet; none after it yet, when it is judged at the next look)."""
        if after is None:
            self._waiting.append((-1 if before is None else before, shown))
            return
        self.judge(shown, -1 if before is None else before, after)

    def judge(self, shown: Shown, before: int, after: int) -> None:
        names = list(shown.names)
        what = shown.what
        if shown.in_order:
            for earlier, later in itertools.pairwise(names):
                if not earlier < later:
                    raise Violation(16, f"{what}: {later!r} after {earlier!r}")
        for name in names:
            if not shown.selects(name):
                raise Violation(16, f"{what}: {name} is not selected by its filters")
            if name not in self.asked:
                raise Violation(16, f"{what}: {name} was never created")
            gone_at = self.gone.get(name)
            if gone_at is not None and gone_at <= before:
                raise Violation(16, f"{what}: {name} shown after a look at {gone_at} missed it")
            shown_id = shown.ids.get(name)
            known = self.ids.get(name, shown_id)
            if shown_id is not None and shown_id != known:
                raise Violation(16, f"{what}: {name} shown as stream {shown_id}, not {known}")
        if shown.complete and before >= 0:
            held = set(self.looks[before].ids) & set(self.looks[after].ids)
            missing = sorted(name for name in held if shown.selects(name) and name not in names)
            if missing:
                raise Violation(16, f"{what}: {missing} held throughout and not shown")
        self.judged += 1


def sound_copies(
    core: SegmentStoreCore, segment: SegmentKey, through: int
) -> dict[int, tuple[EntryKind, bytes]]:
    """What `core` holds of `segment` at 1..`through`, by index, but copies that fail
    their crc32c: a copy rotted at rest (`Checker.rotted`) is a copy of nothing, and
    what a store served or lost is judged on its sound copies."""
    try:
        held = core.reader.read(segment, 1, through)
    except CorruptEntry:
        held = []
        for index in range(1, through + 1):
            with contextlib.suppress(CorruptEntry):
                held += core.reader.read(segment, index, index)
    return {e.index: (e.kind, e.payload) for e in held}
