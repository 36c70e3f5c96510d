"""Seals and integrity: the shell of `core/integrity.py` over the master's records.

A segment is sealed with its writer's certificate when it has one; seals come in
batches (`seal_segments`, a lone `SealSegment` the batch of one), decided each as if it
came alone and committed together (`master.batches`); the stores' scrub
reports of sealed replicas are judged against it and the outcome is recorded durably.
A section of the master's state (`master.state`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from streamengine.master.batches import in_transactions, rounds_by_stream
from streamengine.master.catalog import Batch
from streamengine.master.core import integrity
from streamengine.master.core.errors import (
    InvalidArgument,
    MasterError,
    NotFound,
    NotLeader,
    SealConflict,
)
from streamengine.master.core.model import (
    SegmentKey,
    SegmentRecord,
    SegmentState,
    StreamRecord,
    carry_producers,
)
from streamengine.protocol.certificate import Certificate
from streamengine.protocol.limits import INDEX_MAX
from streamengine.protocol.producers import ProducerPosition

if TYPE_CHECKING:
    from streamengine.master.state import MasterState

# Replicas a store is asked to scrub first, per store, awaiting its next heartbeat.
SCRUB_FIRST_PER_STORE_MAX = 64
# Scrub reports of replicas whose segment the master has not sealed yet, kept for its
# seal (`replica_reported`); beyond this many the oldest go.
EARLY_REPORTS_MAX = 4096


@dataclass(frozen=True, slots=True)
class Seal:
    """One leader's seal of a segment in a batch (`SealSegmentRequest`, checked)."""

    stream: str
    segment_epoch: int
    writer_epoch: int
    final_index: int
    certificate: Certificate | None = None
    lost_from_index: int = 0
    producers: tuple[ProducerPosition, ...] | None = None


@dataclass(frozen=True, slots=True)
class _Sealing:
    """A seal decided, to commit: the segment sealed and the stream's record before and
    after (the producers it carries)."""

    sealed: SegmentRecord
    record: StreamRecord
    carried: StreamRecord

    def ops(self) -> int:
        return 1 + (self.carried is not self.record)


class Integrity:
    """Seals, and what the stores' scrubs say of sealed replicas."""

    def __init__(self, state: MasterState) -> None:
        self.state = state
        # The replicas each store is to check first at its next heartbeat.
        self.scrub_first: dict[str, list[SegmentKey]] = {}

    def seal_segment(
        self,
        name: str,
        segment_epoch: int,
        writer_epoch: int,
        final_index: int,
        now_ms: int,
        certificate: Certificate | None = None,
        lost_from_index: int = 0,
        producers: tuple[ProducerPosition, ...] | None = None,
    ) -> SegmentRecord:
        """One seal: the batch of one (raises its error)."""
        seal = Seal(
            name, segment_epoch, writer_epoch, final_index, certificate, lost_from_index, producers
        )
        (answer,) = self.seal_segments([seal], now_ms)
        if isinstance(answer, MasterError):
            raise answer
        return answer

    def seal_segments(
        self, seals: Sequence[Seal | MasterError], now_ms: int
    ) -> list[SegmentRecord | MasterError]:
        """Decide each seal of a batch (an error in the list stays that entry's answer)
        as if each came alone, one after the other (`batches.rounds_by_stream`); the
        seals of a round are committed in as few transactions as fit them, then
        applied. A commit that fails fails the whole call (what earlier ones sealed
        stands: a seal is idempotent, and its repeat answers it)."""
        answers: dict[int, SegmentRecord | MasterError] = {
            number: seal for number, seal in enumerate(seals) if isinstance(seal, MasterError)
        }
        for seals_of_round in rounds_by_stream(seals, lambda seal: seal.stream):
            answers.update(self._seal_round(seals_of_round, now_ms))
        return [answers[number] for number in range(len(seals))]

    def _seal_round(
        self, seals: list[tuple[int, Seal]], now_ms: int
    ) -> dict[int, SegmentRecord | MasterError]:
        """Seals of distinct streams, decided, committed together, then applied."""
        answers: dict[int, SegmentRecord | MasterError] = {}
        planned: list[tuple[int, _Sealing]] = []
        for number, seal in seals:
            try:
                outcome = self._plan_seal(seal, now_ms)
            except MasterError as error:
                answers[number] = error
                continue
            if isinstance(outcome, SegmentRecord):
                answers[number] = outcome  # sealed already, as this seal says
            else:
                planned.append((number, outcome))
        for run in in_transactions(planned, lambda item: item[1].ops()):
            batch = Batch()
            for _, sealing in run:
                batch.segment(sealing.sealed)
                if sealing.carried is not sealing.record:
                    batch.stream(sealing.carried)
            self.state.catalog.commit(batch)
            for number, sealing in run:
                answers[number] = self._apply_seal(sealing, now_ms)
        return answers

    def _plan_seal(self, seal: Seal, now_ms: int) -> SegmentRecord | _Sealing:
        """What sealing at `seal.final_index` writes: the segment sealed, with the
        sealing leader's certificate (if it knew the whole content) and the range a
        recovery that accepted loss declares lost (`lost_from_index`..`final_index`),
        and the stream's record with the producers it carries. The segment itself when
        it is sealed already as `seal` says (a repeat)."""
        name, segment_epoch, final_index = seal.stream, seal.segment_epoch, seal.final_index
        certificate, lost_from_index = seal.certificate, seal.lost_from_index
        record = self.state.usable_stream(name)
        segment = self.state.segments.get((record.stream_id, segment_epoch))
        if segment is None:
            raise NotFound(f"{name}: no segment of epoch {segment_epoch}")
        if not 1 <= final_index <= INDEX_MAX:
            raise InvalidArgument(f"final index {final_index} outside 1..{INDEX_MAX}")
        if certificate is not None and certificate.final_index != final_index:
            raise InvalidArgument(
                f"the certificate ends at {certificate.final_index}, not at {final_index}"
            )
        if lost_from_index > final_index:
            raise InvalidArgument(
                f"lost range from {lost_from_index} starts past the bridge at {final_index}"
            )
        if segment.state == SegmentState.SEALED:
            if segment.final_index != final_index:
                raise SealConflict(
                    f"{name}: segment {segment_epoch} is sealed at {segment.final_index},"
                    f" not {final_index}"
                )
            # A retried seal carries the same certificate; another one is a contradiction
            # (the first seal alone records one).
            if (
                certificate is not None
                and segment.certified_by == integrity.WRITER
                and certificate != segment.certificate
            ):
                raise SealConflict(
                    f"{name}: segment {segment_epoch} was sealed with another certificate"
                )
            return segment
        if seal.writer_epoch <= segment_epoch:
            raise NotLeader(
                f"sealing segment {segment_epoch} needs a later epoch than {seal.writer_epoch}"
            )
        if seal.writer_epoch > record.epoch:
            raise NotLeader(f"epoch {seal.writer_epoch} was never granted (latest {record.epoch})")
        sealed = replace(
            segment,
            state=SegmentState.SEALED,
            final_index=final_index,
            sealed_at_ms=now_ms,
            settled_at_ms=now_ms,
            certificate=certificate,
            certified_by=integrity.WRITER if certificate is not None else "",
            lost_from_index=lost_from_index,
            producers=seal.producers,
        )
        carried = carry_producers(record, segment_epoch, seal.producers)
        return _Sealing(sealed, record, carried)

    def _apply_seal(self, sealing: _Sealing, now_ms: int) -> SegmentRecord:
        """What `_plan_seal` planned, once committed."""
        sealed = sealing.sealed
        self.state.streams[sealing.carried.name] = sealing.carried
        self.state.put_segment(sealed)
        for member in sealed.copy_set:
            early = self.state.early_reports.pop((sealed.key, member), None)
            if early is not None:
                self.replica_reported(member, sealed.key, early, now_ms)
        return self.state.segments[sealed.key]

    def replica_reported(
        self, store_id: str, key: SegmentKey, report: integrity.Report, now_ms: int
    ) -> integrity.Judgement:
        """A store's scrub read its replica of `key` back: judge it against the
        certificate (`integrity.judge`) and record the outcome durably."""
        segment = self.state.segments.get(key)
        if segment is None:
            return integrity.Judgement(note="not a segment")
        if segment.state != SegmentState.SEALED:
            # A store scrubs a replica once it is sealed there and acked up to its
            # bridge, which its leader does before it seals the segment here: the report
            # may come first. Dropped, it would not come again before the store's
            # re-check (10 minutes), and the segment would count as under-replicated
            # until then (repair, drain and rebalance wait for it).
            if store_id in segment.copy_set:
                self.state.early_reports.pop((key, store_id), None)
                self.state.early_reports[(key, store_id)] = report
                while len(self.state.early_reports) > EARLY_REPORTS_MAX:
                    del self.state.early_reports[next(iter(self.state.early_reports))]
            return integrity.Judgement(note="kept until the segment is sealed")
        if isinstance(report, integrity.Clean) and (
            report.certificate.final_index != segment.final_index
        ):
            return integrity.Judgement(note=f"{store_id} read to another final index")
        stream = self.state.streams.get(self.state.names.get(segment.stream_id, ""))
        if stream is None:
            return integrity.Judgement(note="the stream is gone")
        judgement = integrity.judge(
            segment.certificate,
            segment.certified_by,
            self.state.checks_of(key),
            segment.copy_set,
            stream.write_quorum,
            store_id,
            report,
            now_ms,
        )
        self._record_judgement(segment, judgement)
        for member in judgement.recheck:
            self.ask_scrub_first(member, key)
        return judgement

    def report_replica(self, name: str, segment_epoch: int, address: str) -> str:
        """A reader found the replica at `address` suspect: its store checks it first.
        Returns the store id, "" when the address names no member of the sealed
        segment's copy set (the report is ignored)."""
        record = self.state.stream(name)
        segment = self.state.segments.get((record.stream_id, segment_epoch))
        if segment is None or segment.state != SegmentState.SEALED:
            return ""
        member = next((m for m in segment.copy_set if self.state.address(m) == address), "")
        if member:
            self.ask_scrub_first(member, segment.key)
        return member

    def ask_scrub_first(self, store_id: str, key: SegmentKey) -> None:
        queued = self.scrub_first.setdefault(store_id, [])
        if key not in queued and len(queued) < SCRUB_FIRST_PER_STORE_MAX:
            queued.append(key)

    def take_scrub_first(self, store_id: str) -> list[SegmentKey]:
        """The replicas `store_id` is to check first, handed out once."""
        return self.scrub_first.pop(store_id, [])

    def replica_verification(self) -> tuple[int, int, int]:
        """Over the sealed segments' copy-set members: how many matched the certificate
        (`integrity`), how many not yet, how many are bad."""
        matched = unmatched = bad = 0
        for key, segment in self.state.segments.items():
            if segment.state != SegmentState.SEALED:
                continue
            checks = self.state.checks.get(key)
            for member in segment.copy_set:
                if member in segment.bad:
                    bad += 1
                elif checks is not None and member in checks.verified:
                    matched += 1
                else:
                    unmatched += 1
        return matched, unmatched, bad

    def _record_judgement(self, segment: SegmentRecord, judgement: integrity.Judgement) -> None:
        bad = tuple(sorted(set(segment.bad) | set(judgement.bad)))
        updated = segment
        if judgement.certificate is not None:
            updated = replace(
                updated, certificate=judgement.certificate, certified_by=integrity.REPLICAS
            )
        if bad != segment.bad:
            updated = replace(updated, bad=bad)
        verified = self.state.verified_members(segment)
        if verified != segment.verified:
            updated = replace(updated, verified=verified)
        if updated is not segment:
            self.state.catalog.commit(Batch().segment(updated))
            self.state.put_segment(updated)
