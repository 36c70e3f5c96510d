"""Rebuilding the master's metadata from the stores (`streamengine master --rebuild`).

Pure: what the stores answered in, the catalog out. Each store keeps, beside every
segment it holds, the master's last record of it (`master.records`: stream name and
id, policy, epoch, copy set, seal state, final index, certificate), and reports its
own fence, acked index and acked bridge of it. From those:

- a stream is named by its records (the record of its highest epoch wins; a record
  that names it otherwise is a conflict, logged). Two stream ids under one name: the
  higher id is the stream (ids grow; the lower one was deleted and created again), the
  lower one is not rebuilt (its replicas stay on the stores: no unknown id up to the
  highest rebuilt is garbage, since a store that missed the rebuild may hold the only
  copies of a stream). A stream no record names (created and never written, or its
  records never reached a store) is named as the stores' cluster views carry it (each
  view lists the streams no store kept a record of when the lost master sent it: the
  runtime world's seed 2499, whose one store never had a heartbeat answered after it
  got its segments, or got none of eight streams); one that a view does not name
  either is kept under `<tenant>/stream-<id>` with the tenant its grants told the
  stores, rather than deleted;
- a segment is the record its stores agree on, the sealed one first: two sealed
  records disagreeing on the final index are a conflict (the latest settled is taken,
  logged). A segment no record says is sealed, but whose stores hold an acked bridge, is
  sealed there (a seal whose record had not reached the stores yet). A segment without
  any record gets the copy set the grants of its writes listed, which its stores keep
  from the first write or seal (members that never got a write included, so that the
  recovery finds its R answers among them); without one, the stores that hold it. In a
  sealed segment's copy set, a member that answered without a replica gives its place
  to a store holding a whole sealed copy its record does not name (a repair's), while
  there is one;
- a stream's epoch is `REBUILD_EPOCH_GAP` past the highest epoch any store knows of
  it, as a segment or as a fence. Every epoch a leader wrote or sealed under is at or
  below that highest one, but the lost master may have granted later ones no store saw
  (a grant without a segment, a segment no write reached) and listed them to followers,
  who take an epoch listed without a segment, or a segment listed empty, as a promise
  that no event will ever be there. The next grant is above all of them (and a grant of
  the lost master's is refused by every store that took the rebuilt master's new
  signing key);
- unsealed segments below the stream's epoch are SEALING (a later epoch exists);
- the next stream id is above every id any store holds, and above the highest id the
  lost master gave as any store's cluster view keeps it (a stream whose stores did not
  answer, or one created and never written), so no new stream collides;
- a member of a rebuilt copy set whose database is newer than what it answered for
  (it keeps no cluster id: made since it last joined a master, a wiped disk; or it
  registered as another incarnation after it answered) holds none of the replicas the
  records name it for, save those it listed: they are lost, as a registration with a
  new incarnation makes them (`StoreRecord.lost`, told at its next registration), and
  are no longer verified. The master cannot tell those apart otherwise: registered to
  a master that knows no segment yet, such a store was told it lost nothing, and it
  would answer a recovery's seal as an empty replica and count among the R.

When to decide (`ready`): every store registered so far, every store a record or a
grant names, and every store a cluster view lists has answered; and at least one that
answered keeps a cluster id (a store with a new disk knows nothing of the cluster: no
view, no segment); or the deadline passed. The master knows no store but those that
registered to it: the runtime world's seeds 2008 and 2092, where the one store that
answered held nothing and those holding every stream were down, were rebuilt empty
after the registration grace and gave stream id 1 again.

Tenants are recreated from stream names; tokens are not in the stores and are lost
(the operator issues new ones).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

from streamengine.master.core.model import (
    SegmentKey,
    SegmentRecord,
    SegmentState,
    StoreRecord,
    StreamRecord,
)
from streamengine.protocol.limits import EPOCH_MAX, REPLICAS_MAX

# Stores register again within this long of a master's start: a heartbeat (at most a
# second apart) finds the master does not know them, and a registration retried with
# backoff (at most 2 s apart, `segment_store.master_link`) gets through. The rebuild
# waits at least this long, so that a store no record names is asked too.
REGISTRATION_GRACE_MS = 3_000
# How far past the highest epoch the stores know a rebuilt stream's epoch starts (the
# module doc): more than the lost master can have granted beyond it (a grant to another
# writer waits a lease out, a leader's roll opens a segment it goes on to write), and
# room for two thousand rebuilds below `EPOCH_MAX`. The runtime
# world's seed 9054: the rebuilt master granted epoch 3 again, where a follower had been
# told by the lost master that epoch 3 had no segment, and never read its events.
REBUILD_EPOCH_GAP = 1 << 20

# Stream ids are u64 on the wire and in the metadata: a view past this is malformed.
STREAM_IDS_MAX = 1 << 63

# Why a store's database is newer than the records naming it (`_newer_databases`).
_RENEWED = "registered as a new incarnation after it answered"
_UNJOINED = "keeps no cluster id (a new disk)"

# Roll thresholds of a stream rebuilt without any record (as `state` defaults them).
_SEGMENT_BYTES = 256 << 20
_SEGMENT_AGE_MS = 60 * 60 * 1000


@dataclass(frozen=True, slots=True)
class Holding:
    """One segment as one store holds it, with the master's record it keeps (None: no
    record reached it, or it did not decode)."""

    store_id: str
    stream_id: int
    epoch: int
    fence: int
    acked_index: int
    bridge_index: int
    tenant: str
    record: tuple[StreamRecord, SegmentRecord] | None = None
    # The segment's copy set as the grant of the first write or seal that brought it to
    # the store listed it (empty: not kept, as for a copy the master made).
    copy_set: tuple[str, ...] = ()
    # The stream's name and write quorum as such a grant said them ("" and 0: none did).
    stream_name: str = ""
    write_quorum: int = 0

    def __post_init__(self) -> None:
        assert self.stream_id > 0 and self.epoch > 0, self
        assert len(set(self.copy_set)) == len(self.copy_set) <= REPLICAS_MAX, self
        assert all(self.copy_set), self
        if self.record is not None:
            stream, segment = self.record
            assert segment.key == (self.stream_id, self.epoch), (self, segment.key)
            assert stream.stream_id == self.stream_id and stream.name == segment.stream


@dataclass(frozen=True, slots=True)
class Answered:
    """A store's whole answer to the rebuild (every page of it): the incarnation it was
    registered under when asked (0: not known) and the cluster id it keeps ("": none,
    its database was made since it last joined a master)."""

    incarnation: int
    cluster_id: str


@dataclass(frozen=True, slots=True)
class View:
    """The cluster view a store keeps (`v1.ClusterView`), as the lost master last sent
    it: every store it knew, the highest stream id it gave, and the streams no store
    kept a record of then (epoch 0, no holder: a card does not know them)."""

    stores: tuple[str, ...] = ()
    stream_ids_through: int = 0
    streams: tuple[StreamRecord, ...] = ()


@dataclass
class Rebuilt:
    tenants: dict[str, int] = field(default_factory=dict)
    streams: dict[str, StreamRecord] = field(default_factory=dict)
    segments: dict[SegmentKey, SegmentRecord] = field(default_factory=dict)
    # The registered stores told of replicas lost with a newer database: their records
    # with those in `lost`, answered at their next registration.
    stores: dict[str, StoreRecord] = field(default_factory=dict)
    next_stream_id: int = 1
    # Conflicts and guesses, one line each, for the log.
    notes: list[str] = field(default_factory=list)
    # The id the stores keep ("": none keeps one; the master makes a new one).
    cluster_id: str = ""


def adopted_cluster_id(kept: dict[str, str]) -> tuple[str, list[str]]:
    """The cluster id to adopt from what each store keeps ("": none), and a note per
    store that keeps another (it will refuse to join and stop: the operator decides).
    The id most stores keep wins; ties go to the first in order."""
    counts: dict[str, int] = {}
    for cluster_id in kept.values():
        if cluster_id:
            counts[cluster_id] = counts.get(cluster_id, 0) + 1
    if not counts:
        return "", []
    chosen = min(counts, key=lambda c: (-counts[c], c))
    notes = [
        f"store {store} keeps cluster id {cluster_id}, not {chosen}: it will not join"
        for store, cluster_id in sorted(kept.items())
        if cluster_id and cluster_id != chosen
    ]
    return chosen, notes


def ready(
    registered: Iterable[str],
    answered: Iterable[str],
    named: Iterable[str],
    now_ms: int,
    deadline_ms: int,
    earliest_ms: int = 0,
    *,
    joined: Iterable[str],
) -> bool:
    """Whether to rebuild now: every store registered so far and every store named
    (`named_stores`) has answered, at least one that answered keeps a cluster id
    (`joined`), and stores had `earliest_ms` to register; or the deadline passed."""
    done = set(answered)
    if now_ms >= deadline_ms:
        return True
    if now_ms < earliest_ms:
        return False
    return bool(set(joined) & done) and set(registered) <= done and set(named) <= done


def missing(registered: Iterable[str], answered: Iterable[str], named: Iterable[str]) -> list[str]:
    """Stores registered or named by a record that did not answer."""
    return sorted((set(registered) | set(named)) - set(answered))


def named_stores(holdings: Iterable[Holding], views: Iterable[View] = ()) -> set[str]:
    """The stores the records name, those the grants name of a segment no record
    reached, and those the stores' cluster views list: the rebuild waits for each
    (until its deadline)."""
    holdings = list(holdings)
    recorded = {(h.stream_id, h.epoch) for h in holdings if h.record is not None}
    return (
        {m for h in holdings if h.record is not None for m in h.record[1].copy_set}
        | {m for h in holdings if (h.stream_id, h.epoch) not in recorded for m in h.copy_set}
        | {m for view in views for m in view.stores}
    )


def rebuild(
    holdings: Iterable[Holding],
    now_ms: int,
    answered: Mapping[str, Answered] | None = None,
    registered: Mapping[str, StoreRecord] | None = None,
    views: Iterable[View] = (),
) -> Rebuilt:
    """The catalog from what the stores hold (`holdings`); `answered`: the stores whose
    answers were whole, `registered`: every store's record as it registers now,
    `views`: the cluster views the stores that answered keep."""
    holdings = list(holdings)
    views = list(views)
    notes: list[str] = []
    cards = _cards(views, notes)
    out = _catalog(holdings, now_ms, set(answered or ()), cards)
    out.notes[:0] = notes
    _next_stream_id(out, views)
    newer = _newer_databases(answered or {}, registered or {})
    if newer:
        _lose_replicas(out, holdings, newer, registered or {})
    return out


def _catalog(
    holdings: list[Holding], now_ms: int, answered: set[str], cards: dict[int, StreamRecord]
) -> Rebuilt:
    by_stream: dict[int, list[Holding]] = {}
    for holding in holdings:
        by_stream.setdefault(holding.stream_id, []).append(holding)
    out = Rebuilt()
    if not by_stream and not cards:
        return out
    out.next_stream_id = max([*by_stream, *cards]) + 1
    named: dict[str, StreamRecord] = {}
    for stream_id in sorted({*by_stream, *cards}):
        group = by_stream.get(stream_id, [])
        if group:
            stream = _stream(stream_id, group, out.notes, cards.get(stream_id))
        else:
            stream = cards[stream_id]
            out.notes.append(
                f"{stream.name} (stream id {stream_id}): no store that answered holds any "
                "of it; rebuilt as the stores' cluster views carry it"
            )
        earlier = named.get(stream.name)
        if earlier is not None:
            out.notes.append(
                f"{stream.name}: stream id {earlier.stream_id} not rebuilt (the name has id "
                f"{stream_id}: deleted and created again); its replicas stay on the stores"
            )
        named[stream.name] = stream
    for stream in named.values():
        group = by_stream.get(stream.stream_id, [])
        known = max((max(h.epoch, h.fence) for h in group), default=0)
        epoch = max(known, min(known + REBUILD_EPOCH_GAP, EPOCH_MAX - 1))
        # Marked as having producers if any record says so: a record sent before the
        # mark keeps its old bytes until the store is sent the new one.
        kept = [h.record[0] for h in group if h.record is not None]
        has_producers = any(r.has_producers for r in kept)
        newest = max(kept, key=lambda r: r.producers_epoch, default=stream)
        stream = replace(
            stream,
            epoch=epoch,
            leader_id="",
            has_producers=has_producers or stream.has_producers,
            producers=newest.producers,
            producers_epoch=newest.producers_epoch,
        )
        out.streams[stream.name] = stream
        out.tenants.setdefault(stream.tenant, now_ms)
        for segment_epoch in sorted({h.epoch for h in group}):
            held = [h for h in group if h.epoch == segment_epoch]
            segment = _segment(stream, held, now_ms, out.notes)
            if segment.state == SegmentState.SEALED:
                segment = _sealed_copy_set(stream, segment, held, answered, now_ms, out.notes)
            out.segments[segment.key] = segment
        _check_stream(stream, [s for k, s in out.segments.items() if k[0] == stream.stream_id])
    assert all(s.stream_id < out.next_stream_id for s in out.streams.values())
    return out


def _cards(views: list[View], notes: list[str]) -> dict[int, StreamRecord]:
    """The streams the views carry, by id: a stream no store kept a record of when the
    lost master sent its view. Views sent at different times may differ (a stream the
    later one no longer carries got its records to a store since, or was deleted); a
    card names a stream whatever view carries it, and where two disagree (never, but
    for a master's bug) the one of the newest view, by its highest stream id, wins."""
    cards: dict[int, StreamRecord] = {}
    for view in sorted(views, key=lambda v: v.stream_ids_through):
        for card in view.streams:
            known = cards.get(card.stream_id)
            if known is not None and known != card:
                notes.append(
                    f"stream id {card.stream_id}: the stores' views name it {known.name} "
                    f"and {card.name}; took {card.name} (the newest view)"
                )
            cards[card.stream_id] = card
    return cards


def _next_stream_id(out: Rebuilt, views: Iterable[View]) -> None:
    """Past the highest stream id the lost master gave, as the stores' views keep it,
    where that is above every id they hold: no new stream takes an id a store that did
    not answer may hold, nor one a client was given for a stream never written."""
    given = max(
        (v.stream_ids_through for v in views if v.stream_ids_through < STREAM_IDS_MAX),
        default=0,
    )
    if given < out.next_stream_id:
        return
    out.notes.append(
        f"the stores' cluster views say the lost master gave stream ids up to {given}; "
        f"none above {out.next_stream_id - 1} is held by a store that answered: the "
        f"next stream id is {given + 1}"
    )
    out.next_stream_id = given + 1


def _newer_databases(
    answered: Mapping[str, Answered], registered: Mapping[str, StoreRecord]
) -> dict[str, str]:
    """The registered stores that answered whose database is newer than the records
    naming them, each with why."""
    newer = {}
    for store_id, answer in sorted(answered.items()):
        record = registered.get(store_id)
        if record is None:
            continue
        if answer.incarnation and record.incarnation and answer.incarnation != record.incarnation:
            newer[store_id] = _RENEWED
        elif not answer.cluster_id:
            newer[store_id] = _UNJOINED
    return newer


def _lose_replicas(
    out: Rebuilt,
    holdings: list[Holding],
    newer: dict[str, str],
    registered: Mapping[str, StoreRecord],
) -> None:
    """Each member of `newer` loses the rebuilt replicas it does not hold as it runs
    now (an incarnation registered since its answer holds none of what it listed)."""
    held = {
        (h.store_id, (h.stream_id, h.epoch)) for h in holdings if newer.get(h.store_id) == _UNJOINED
    }
    lost: dict[str, list[SegmentKey]] = {}
    for key, segment in sorted(out.segments.items()):
        gone = [m for m in segment.copy_set if m in newer and (m, key) not in held]
        for member in gone:
            lost.setdefault(member, []).append(key)
        if gone and set(gone) & set(segment.verified):
            out.segments[key] = replace(
                segment, verified=tuple(m for m in segment.verified if m not in gone)
            )
    for store_id, keys in sorted(lost.items()):
        record = registered[store_id]
        out.stores[store_id] = replace(record, lost=tuple(sorted({*record.lost, *keys})))
        out.notes.append(
            f"store {store_id} {newer[store_id]}: {len(keys)} replicas its copy sets name are lost"
        )


def _stream(
    stream_id: int, group: list[Holding], notes: list[str], card: StreamRecord | None
) -> StreamRecord:
    """The stream a stream id's records name (that of its highest epoch); without any,
    as a cluster view's card names it; without one, as the grants its stores kept name
    it; without those, under its tenant. (Only records and cards carry a policy: else it
    is the copy sets' size and a majority.)"""
    records = sorted((h.record for h in group if h.record is not None), key=lambda r: r[1].epoch)
    if not records and card is not None:
        notes.append(
            f"stream id {stream_id}: no store holds a record of it; named {card.name} "
            "as the stores' cluster views carry it"
        )
        return card
    if not records:
        tenants = sorted({h.tenant for h in group if h.tenant})
        tenant = tenants[0] if tenants else "recovered"
        epochs = {h.epoch for h in group}
        members = max(
            len(_unrecorded_copy_set([h for h in group if h.epoch == e])[0]) for e in epochs
        )
        replicas = min(max(members, 1), REPLICAS_MAX)
        # As for records: the grant of its highest epoch.
        named = max((h for h in group if h.stream_name), key=lambda h: h.epoch, default=None)
        name = named.stream_name if named else f"{tenant}/stream-{stream_id}"
        said = named.write_quorum if named else 0
        quorum = said if 0 < said <= replicas else replicas // 2 + 1
        how = "named as its grants said" if named else "kept"
        names = sorted({h.stream_name for h in group if h.stream_name})
        if len(names) > 1:
            notes.append(f"stream id {stream_id}: its grants name it {names}")
        notes.append(
            f"stream id {stream_id}: no store holds a record of it; {how} {name} "
            f"({replicas} replicas, write quorum {quorum})"
        )
        return StreamRecord(
            name, stream_id, replicas, quorum, _SEGMENT_BYTES, _SEGMENT_AGE_MS, 0, "", 0
        )
    stream = records[-1][0]
    others = sorted({r[0].name for r in records} - {stream.name})
    if others:
        notes.append(f"stream id {stream_id}: records name it {stream.name} and {others}")
    return stream


def _segment(
    stream: StreamRecord, held: list[Holding], now_ms: int, notes: list[str]
) -> SegmentRecord:
    key = (stream.stream_id, held[0].epoch)
    records = [h.record[1] for h in held if h.record is not None]
    sealed = [r for r in records if r.state == SegmentState.SEALED]
    if sealed:
        finals = sorted({r.final_index for r in sealed})
        chosen = max(sealed, key=lambda r: (r.settled_at_ms, sum(x == r for x in sealed)))
        if len(finals) > 1:
            notes.append(
                f"{stream.name} segment {key[1]}: sealed records disagree on the final "
                f"index {finals}; took {chosen.final_index} (settled last)"
            )
        return replace(chosen, stream=stream.name)
    if records:
        chosen = max(records, key=lambda r: (int(r.state), r.settled_at_ms))
    else:
        copy_set, why = _unrecorded_copy_set(held)
        chosen = SegmentRecord(
            stream.stream_id, stream.name, key[1], copy_set, SegmentState.OPEN, 0, now_ms, 0, now_ms
        )
        notes.append(f"{stream.name} segment {key[1]}: no record; {why}")
    chosen = replace(chosen, stream=stream.name)
    bridges = sorted({h.bridge_index for h in held if h.bridge_index})
    if bridges:
        if len(bridges) > 1:
            notes.append(f"{stream.name} segment {key[1]}: stores hold bridges at {bridges}")
        notes.append(
            f"{stream.name} segment {key[1]}: sealed at {bridges[0]} (its stores' bridge; "
            "the seal's record had not reached them)"
        )
        return replace(
            chosen,
            state=SegmentState.SEALED,
            final_index=bridges[0],
            sealed_at_ms=now_ms,
            settled_at_ms=now_ms,
        )
    if chosen.state == SegmentState.OPEN and key[1] < stream.epoch:
        chosen = replace(chosen, state=SegmentState.SEALING)
    return chosen


def _unrecorded_copy_set(held: list[Holding]) -> tuple[tuple[str, ...], str]:
    """The copy set of a segment no record reached, and why: as the grants that
    brought it to its stores listed it, members that never got a write included (the
    runtime world's seed 432: a segment opened on five stores, written on two before
    the metadata was lost, rebuilt on those two, waited for good for a recovery's R = 3
    answers); else, when no store kept it, or the stores disagree, or one holds it
    outside it, the stores that hold it."""
    holders = tuple(sorted({h.store_id for h in held}))
    granted = sorted({h.copy_set for h in held if h.copy_set})
    if len(granted) == 1 and set(holders) <= set(granted[0]):
        members = granted[0]
        return members, (
            f"its copy set is the one its grants listed ({', '.join(members)}), "
            f"held on {', '.join(holders)}"
        )
    if granted:
        kept = "; ".join(", ".join(g) for g in granted)
        return holders, (
            f"its stores keep copy sets ({kept}) that do not name every store holding "
            f"it; its copy set is the stores that hold it ({', '.join(holders)})"
        )
    return holders, f"its copy set is the stores that hold it ({', '.join(holders)})"


def _sealed_copy_set(
    stream: StreamRecord,
    segment: SegmentRecord,
    held: list[Holding],
    answered: set[str],
    now_ms: int,
    notes: list[str],
) -> SegmentRecord:
    """A sealed segment's copy set as its stores hold it: a member of the record that
    answered wholly without a replica gives its place to a store holding a whole sealed
    copy the record does not name (a repair's, whose new copy set no record took to the
    stores before the metadata was lost), while there is one. Named still, it would
    stand for a replica it no longer keeps, and the repair's copy would be deleted as
    garbage (the runtime world's seed 67 on the hedged dial's schedules: a repair had
    moved the segment off a wiped store, whose lost mark was deleted since). With no
    such copy the member stays, for the repair to refill (it missed the bridge)."""
    holders = {h.store_id for h in held}
    whole = sorted(
        h.store_id
        for h in held
        if h.store_id not in segment.copy_set
        and h.fence > segment.epoch
        and h.acked_index >= segment.final_index
    )
    copy_set = list(segment.copy_set)
    for place, member in enumerate(segment.copy_set):
        if whole and member in answered and member not in holders:
            copy_set[place] = whole.pop(0)
    if tuple(copy_set) == segment.copy_set:
        return segment
    notes.append(
        f"{stream.name} segment {segment.epoch}: its record names {', '.join(segment.copy_set)}; "
        f"the stores hold it on {', '.join(copy_set)}"
    )
    return replace(
        segment,
        copy_set=tuple(copy_set),
        settled_at_ms=now_ms,
        bad=tuple(m for m in segment.bad if m in copy_set),
        verified=tuple(m for m in segment.verified if m in copy_set),
    )


def _check_stream(stream: StreamRecord, segments: list[SegmentRecord]) -> None:
    for segment in segments:
        assert segment.copy_set, segment
        assert segment.epoch <= stream.epoch, (stream, segment)
        assert segment.stream == stream.name and segment.stream_id == stream.stream_id
        assert (segment.state == SegmentState.SEALED) == (segment.final_index > 0), segment
