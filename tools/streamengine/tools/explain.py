"""`streamengine stream explain NAME`: what a recovery of each unsealed segment would find
and do right now, from the live stores, writing nothing.

The probe asks every store of a segment's copy set for its state (`GetSegmentState`:
fence, acked, matched and last index) and reads what it holds from the first index a
recovery would read (`Read`, unacked entries included). It never seals. The decision is
the writer's own planner (`client.core.recovery.plan_recovery`) at the epoch the next
leader would get, run for every set of R stores that could answer a real recovery's
seals first: a recovery decides from the first R stores that answer, so where those sets
disagree the outcome depends on which stores answer first, and the explanation says so.
"""

from __future__ import annotations

import argparse
import itertools
import json
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import grpc

from streamengine.client.core.recovery_plan import (
    RecoveryError,
    RecoveryPlan,
    SealAnswer,
    StoreAnswer,
    plan_recovery,
)
from streamengine.protocol import framed_read
from streamengine.protocol.codec import entries_from_pb
from streamengine.protocol.entry import EntryKind, StoredEntry
from streamengine.protocol.framed import CallError
from streamengine.protocol.policy import ReplicationPolicy
from streamengine.protocol.transport import PLAINTEXT, Transport
from streamengine.tools.ops import RPC_TIMEOUT_S, client_transport, master_stub
from streamengine.v1 import entry_pb2, master_pb2, segment_store_pb2
from streamengine.v1 import segment_store_pb2_grpc as store_grpc

# ---- what the stores hold ----


@dataclass(frozen=True)
class StoreProbe:
    """One copy-set store's state and entries, or why it could not be asked."""

    store: str
    address: str
    answer: StoreAnswer | None
    error: str = ""


def probe_store(
    transport: Transport, store: str, address: str, segment: entry_pb2.SegmentId
) -> SealAnswer | str:
    """The store's state of `segment` as a seal would report it (before raising the
    fence), or why it could not be asked. A store that never heard of the segment
    answers as an empty one, as it would to a seal."""
    try:
        with transport.channel(address) as channel:
            reply = store_grpc.SegmentStoreStub(channel).GetSegmentState(
                segment_store_pb2.GetSegmentStateRequest(segment=segment),
                timeout=RPC_TIMEOUT_S,
            )
    except grpc.RpcError as error:
        if error.code() == grpc.StatusCode.NOT_FOUND:
            return SealAnswer(store, 0, 0, 0, 0)
        return f"{error.code().name}: {(error.details() or '')[:100]}"
    return SealAnswer(store, reply.fence, reply.acked_index, reply.matched_index, reply.last_index)


def read_store(
    transport: Transport, data_address: str, segment: entry_pb2.SegmentId, from_index: int
) -> list[StoredEntry]:
    """Everything the store holds of `segment` from `from_index` on, acked or not (read
    on its data port). Raises CallError."""
    request = segment_store_pb2.ReadRequest(
        segment=segment, from_index=from_index, to_index=0, acked_only=False
    )
    entries: list[StoredEntry] = []
    for reply in framed_read.read_sync(data_address, transport, request, RPC_TIMEOUT_S):
        entries.extend(entries_from_pb(reply.entries))
    return entries


# ---- the explanation ----


@dataclass(frozen=True)
class Run:
    """Consecutive chosen copies of one kind, above the acked index."""

    first_index: int
    last_index: int
    kind: str


@dataclass(frozen=True)
class Outcome:
    """What a recovery deciding from `decided_from` would do."""

    decided_from: tuple[str, ...]
    acked_index: int
    acked_store: str
    final_index: int
    existing_bridge: bool
    chosen: tuple[Run, ...]
    holes: tuple[int, ...]
    # Per store (the ones decided from and every other store that answers the seal):
    # the indexes it would be written, empty when it holds the run already.
    rewrites: dict[str, tuple[int, int]]

    def decision(self) -> tuple[Any, ...]:
        """What the recovery decides, whoever it decided from."""
        return (self.final_index, self.existing_bridge, self.chosen, self.holes)


@dataclass
class SegmentExplanation:
    epoch: int
    state: str
    copy_set: tuple[str, ...]
    replicas: int
    write_quorum: int
    read_quorum: int
    next_epoch: int
    probes: list[StoreProbe] = field(default_factory=list)
    outcomes: list[Outcome] = field(default_factory=list)
    problem: str = ""
    # The answers did not fit together (a store's state moved while it was probed).
    answers_disagree: bool = False

    @property
    def quorum_reachable(self) -> bool:
        return sum(p.answer is not None for p in self.probes) >= self.read_quorum

    @property
    def decided(self) -> bool:
        """Every set of R stores that could answer first leads to the same decision."""
        return bool(self.outcomes) and len({o.decision() for o in self.outcomes}) == 1


def runs_of(copies: Sequence[StoredEntry]) -> tuple[Run, ...]:
    runs: list[Run] = []
    for entry in copies:
        kind = EntryKind(entry.kind).name
        last = runs[-1] if runs else None
        if last is not None and last.kind == kind and last.last_index + 1 == entry.index:
            runs[-1] = Run(last.first_index, entry.index, kind)
        else:
            runs.append(Run(entry.index, entry.index, kind))
    return tuple(runs)


def outcome_of(
    plan: RecoveryPlan, decided_from: tuple[str, ...], answers: Sequence[StoreAnswer]
) -> Outcome:
    rewrites = {answer.store: (answer.seal.acked_index + 1, plan.final_index) for answer in answers}
    return Outcome(
        decided_from=decided_from,
        acked_index=plan.acked_index,
        acked_store=plan.acked_store,
        final_index=plan.final_index,
        existing_bridge=plan.existing_bridge,
        chosen=runs_of([c for c in plan.copies if c.index > plan.acked_index]),
        holes=plan.holes,
        rewrites=rewrites,
    )


def explain_answers(
    policy: ReplicationPolicy, next_epoch: int, answers: Sequence[StoreAnswer]
) -> list[Outcome]:
    """The planner's decision for every R-subset of the stores that answered."""
    outcomes = []
    for subset in itertools.combinations(answers, policy.read_quorum):
        plan = plan_recovery(policy, next_epoch, subset)
        outcomes.append(outcome_of(plan, tuple(a.store for a in subset), answers))
    return outcomes


# A store's state can move between the probe of its state and the read of its entries (a
# write or an acked index arriving meanwhile): answers that do not fit together are
# probed again this many times before the explanation says they cannot be planned from.
PROBE_ATTEMPTS = 3


def explain_segment(
    transport: Transport,
    stream_id: int,
    name: str,
    segment: entry_pb2.Segment,
    policy: ReplicationPolicy,
    next_epoch: int,
) -> SegmentExplanation:
    for _ in range(PROBE_ATTEMPTS):
        explanation = _probe_segment(transport, stream_id, name, segment, policy, next_epoch)
        if not explanation.answers_disagree:
            break
    return explanation


def first_index_to_read(answered: Sequence[SealAnswer]) -> int:
    """Where to read every store from. Every set of R answers is planned, each from its
    own `read_from_index`, never below the lowest acked index of all the answers: read
    from there, every plan finds its final copies (from `read_from_index` of all the
    answers, a set of the stores acked lowest would miss its own acked index)."""
    return max(1, min((s.acked_index for s in answered), default=1))


def _probe_segment(
    transport: Transport,
    stream_id: int,
    name: str,
    segment: entry_pb2.Segment,
    policy: ReplicationPolicy,
    next_epoch: int,
) -> SegmentExplanation:
    epoch = segment.id.epoch
    explanation = SegmentExplanation(
        epoch=epoch,
        state=entry_pb2.SegmentState.Name(segment.state).lower(),
        copy_set=tuple(r.store_id for r in segment.copy_set),
        replicas=policy.replicas,
        write_quorum=policy.write_quorum,
        read_quorum=policy.read_quorum,
        next_epoch=next_epoch,
    )
    segment_id = entry_pb2.SegmentId(stream_id=stream_id, epoch=epoch, stream=name)
    states: dict[str, SealAnswer | str] = {
        r.store_id: probe_store(transport, r.store_id, r.address, segment_id)
        for r in segment.copy_set
    }
    answered = [s for s in states.values() if isinstance(s, SealAnswer)]
    from_index = first_index_to_read(answered)
    for replica in segment.copy_set:
        state = states[replica.store_id]
        if isinstance(state, str):
            explanation.probes.append(StoreProbe(replica.store_id, replica.address, None, state))
            continue
        try:
            entries = read_store(transport, replica.data_address, segment_id, from_index)
        except CallError as error:
            problem = f"read failed: {error.code.name}: {error.details}"
            explanation.probes.append(StoreProbe(replica.store_id, replica.address, None, problem))
            continue
        # What was read may have grown since the state was taken (a leader still writes).
        held = [e for e in entries if e.index <= state.last_index]
        answer = StoreAnswer(state, tuple(held))
        explanation.probes.append(StoreProbe(replica.store_id, replica.address, answer))
    answers = [p.answer for p in explanation.probes if p.answer is not None]
    if not explanation.quorum_reachable:
        explanation.problem = (
            f"only {len(answers)} of the copy set answer; a recovery needs R = "
            f"{policy.read_quorum} and waits until enough come back"
        )
        return explanation
    try:
        explanation.outcomes = explain_answers(policy, next_epoch, answers)
    except RecoveryError as error:
        read = ", ".join(
            f"{a.store} {a.entries[0].index}..{a.entries[-1].index}" if a.entries else a.store
            for a in answers
        )
        explanation.answers_disagree = True
        explanation.problem = (
            f"the answers cannot be planned from: {error} (read from {from_index}: {read})"
        )
    return explanation


@dataclass
class StreamExplanation:
    stream: str
    epoch: int
    leader_id: str
    segments: list[SegmentExplanation]


def explain_stream(
    master_address: str,
    name: str,
    transport: Transport = PLAINTEXT,
) -> StreamExplanation:
    with master_stub(master_address, transport) as master:
        info = master.DescribeStream(
            master_pb2.DescribeStreamRequest(name=name), timeout=RPC_TIMEOUT_S
        )
        listing = master.ListSegments(
            master_pb2.ListSegmentsRequest(stream=name), timeout=RPC_TIMEOUT_S
        )
    policy = ReplicationPolicy(info.policy.replicas, info.policy.write_quorum)
    unsealed = [s for s in listing.segments if s.state != entry_pb2.SEALED]
    return StreamExplanation(
        stream=name,
        epoch=info.epoch,
        leader_id=info.leader_id,
        segments=[
            explain_segment(transport, listing.stream_id, name, s, policy, info.epoch + 1)
            for s in unsealed
        ],
    )


# ---- output ----


def explanation_dict(explanation: StreamExplanation) -> dict[str, Any]:
    def segment(s: SegmentExplanation) -> dict[str, Any]:
        return {
            "epoch": s.epoch,
            "state": s.state,
            "copy_set": list(s.copy_set),
            "replicas": s.replicas,
            "write_quorum": s.write_quorum,
            "read_quorum": s.read_quorum,
            "recovery_epoch": s.next_epoch,
            "quorum_reachable": s.quorum_reachable,
            "decided": s.decided,
            "problem": s.problem,
            "stores": [
                {
                    "store": p.store,
                    "address": p.address,
                    "error": p.error,
                    **(
                        {
                            "fence": p.answer.seal.fence,
                            "acked_index": p.answer.seal.acked_index,
                            "matched_index": p.answer.seal.matched_index,
                            "last_index": p.answer.seal.last_index,
                        }
                        if p.answer
                        else {}
                    ),
                }
                for p in s.probes
            ],
            "outcomes": [asdict(o) for o in s.outcomes],
        }

    return {
        "stream": explanation.stream,
        "epoch": explanation.epoch,
        "leader_id": explanation.leader_id,
        "unsealed_segments": [segment(s) for s in explanation.segments],
    }


def _ranges(indexes: Sequence[int]) -> str:
    if not indexes:
        return "none"
    parts: list[str] = []
    for _, group in itertools.groupby(enumerate(indexes), lambda pair: pair[1] - pair[0]):
        run = [index for _, index in group]
        parts.append(str(run[0]) if len(run) == 1 else f"{run[0]}..{run[-1]}")
    return ", ".join(parts)


def explanation_lines(explanation: StreamExplanation) -> Iterator[str]:
    leader = explanation.leader_id or "nobody"
    yield f"{explanation.stream}: epoch {explanation.epoch}, leader {leader}"
    if not explanation.segments:
        yield "  every segment is sealed: a new leader has nothing to recover"
        return
    for s in explanation.segments:
        yield (
            f"segment {s.epoch} ({s.state}), copy set {' '.join(s.copy_set)}; "
            f"N={s.replicas} W={s.write_quorum} R={s.read_quorum}; "
            f"a recovery now would run at epoch {s.next_epoch}"
        )
        for p in s.probes:
            if p.answer is None:
                yield f"  {p.store:<12} unreachable: {p.error}"
            else:
                seal = p.answer.seal
                yield (
                    f"  {p.store:<12} fence {seal.fence} acked {seal.acked_index} "
                    f"matched {seal.matched_index} last {seal.last_index}"
                )
        if s.problem:
            yield f"  no recovery possible now: {s.problem}"
            continue
        groups: dict[tuple[Any, ...], list[Outcome]] = {}
        for outcome in s.outcomes:
            groups.setdefault(outcome.decision(), []).append(outcome)
        if len(groups) > 1:
            yield (
                f"  the outcome depends on which {s.read_quorum} stores answer the seal "
                f"first ({len(groups)} possible decisions):"
            )
        for outcomes in groups.values():
            first = outcomes[0]
            sets = " | ".join("{" + ",".join(o.decided_from) + "}" for o in outcomes)
            yield f"  deciding from {sets}:"
            yield f"    final up to acked index {first.acked_index} (from {first.acked_store})"
            for run in first.chosen:
                yield f"    {run.first_index}..{run.last_index}: {run.kind}"
            yield f"    holes: {_ranges(first.holes)}"
            where = "already there" if first.existing_bridge else "new"
            yield f"    bridge at {first.final_index} ({where})"
            writes = [
                f"{store} {lo}..{hi}" if lo <= hi else f"{store} nothing"
                for store, (lo, hi) in sorted(first.rewrites.items())
            ]
            yield f"    writes: {'; '.join(writes)}"


def cmd_stream_explain(args: argparse.Namespace) -> int:
    """Explain what a recovery of each unsealed segment would do now (writes nothing)."""
    explanation = explain_stream(args.master, args.name, client_transport(args))
    if args.json:
        print(json.dumps(explanation_dict(explanation), indent=2))
    else:
        for line in explanation_lines(explanation):
            print(line)
    return 0
