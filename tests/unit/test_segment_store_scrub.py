"""A store reading its sealed replicas back (`streamengine.segment_store.core.scrub`): one replica's
scan, the schedule (which next, how fast), the certificate of what a replica holds, and
a copy verified against the segment's certificate (`copy_rules`)."""

from __future__ import annotations

import pytest

from streamengine.protocol.certificate import certificate_of
from streamengine.protocol.entry import EntryKind, StoredEntry, encode_value
from streamengine.segment_store.core import copy as copy_rules
from streamengine.segment_store.core.commands import SegmentKey
from streamengine.segment_store.core.errors import CopyMismatch
from streamengine.segment_store.core.keys import entry_key
from streamengine.segment_store.core.kv import Put
from streamengine.segment_store.core.scrub import ReplicaScan, ScrubSchedule
from streamengine.segment_store.kv import MemoryKV
from tests.store_commands import CommandedCore
from tests.unit.test_segment_store_core import _DamagedKV

SEG = SegmentKey(7, 3)
EVENT, BRIDGE = EntryKind.EVENT, EntryKind.BRIDGE


def sealed_replica(kv: MemoryKV | None = None, events: int = 10) -> CommandedCore:
    """A replica of SEG sealed at epoch 4 and acked up to its bridge at events + 1."""
    core = CommandedCore(kv or MemoryKV())
    entries = [StoredEntry.make(i, EVENT, 3, b"p%d" % i) for i in range(1, events + 1)]
    core.write(SEG, 3, events, entries)
    core.seal(SEG, 4)
    core.write(SEG, 4, events + 1, [StoredEntry.make(events + 1, BRIDGE, 4)])
    return core


def the_certificate(events: int = 10):
    rows = [(i, int(EVENT), b"p%d" % i) for i in range(1, events + 1)]
    return certificate_of([*rows, (events + 1, int(BRIDGE), b"")])


def overwrite(core: CommandedCore, index: int, payload: bytes, valid_crc: bool) -> None:
    """Change a stored copy behind the store's back, as bit rot or a bug would."""
    key = entry_key(SEG.stream_id, SEG.epoch, index)
    good = StoredEntry.make(index, EVENT, 3, b"p%d" % index)
    crc = StoredEntry.make(index, EVENT, 3, payload).crc32c if valid_crc else good.crc32c
    core.kv.write([Put(key, encode_value(EVENT, 3, crc, payload))], sync=True)


# ---- the certificate of what a replica holds ----


def test_a_clean_replica_makes_the_segments_certificate_whatever_its_copy_epochs() -> None:
    core = sealed_replica()
    assert core.reader.certify(SEG, 11).certificate == the_certificate()
    # The same content under another copy epoch (a recovery rewrote it) certifies alike.
    other = CommandedCore(MemoryKV())
    other.write(SEG, 5, 0, [StoredEntry.make(i, EVENT, 5, b"p%d" % i) for i in range(1, 11)])
    other.write(SEG, 5, 0, [StoredEntry.make(11, BRIDGE, 5)])
    assert other.reader.certify(SEG, 11).certificate == the_certificate()


@pytest.mark.parametrize(
    ("rule", "valid_crc", "damaged_index"),
    [
        ("a flipped payload bit fails the copy's crc: damaged at that index", False, 4),
        ("a wrong copy whose crc is valid passes the scan but not the certificate", True, 0),
    ],
)
def test_a_changed_copy(rule: str, valid_crc: bool, damaged_index: int) -> None:
    core = sealed_replica()
    overwrite(core, 4, b"p5", valid_crc)
    result = core.reader.certify(SEG, 11)
    assert result.damaged_index == damaged_index, rule
    if damaged_index:
        assert result.certificate is None and "crc32c" in result.detail
    else:
        assert result.certificate is not None and result.certificate != the_certificate()


def test_a_block_the_engine_cannot_read_is_damage_and_the_segment_is_marked() -> None:
    kv = _DamagedKV()
    core = sealed_replica(kv)
    kv.damaged_from = entry_key(SEG.stream_id, SEG.epoch, 6)
    result = core.reader.certify(SEG, 11)
    assert result.damaged and not result.missing and "Corruption" in result.detail
    assert core.catalog.damaged() == {SEG}
    assert SEG not in core.catalog.scrub_targets(), "a replica known damaged is not scrubbed again"


def test_an_index_missing_below_the_bridge_is_named() -> None:
    core = CommandedCore(MemoryKV())
    core.write(SEG, 3, 0, [StoredEntry.make(i, EVENT, 3, b"p%d" % i) for i in (1, 2)])
    core.write(SEG, 3, 0, [StoredEntry.make(4, EVENT, 3, b"p4")])
    result = core.reader.certify(SEG, 4)
    assert result.missing and result.damaged_index == 3


def test_only_sealed_replicas_acked_to_their_bridge_are_scrubbed() -> None:
    core = sealed_replica()
    open_one = SegmentKey(7, 5)
    core.write(open_one, 5, 2, [StoredEntry.make(i, EVENT, 5, b"x") for i in (1, 2)])
    assert core.catalog.scrub_targets() == {SEG: 11}


# ---- one replica in steps ----


def test_a_scan_reads_in_bounded_steps_and_ends_with_the_certificate() -> None:
    core = sealed_replica()
    scan = ReplicaScan(11, step_entries=4, step_bytes=1 << 20)
    steps = []
    while (step := scan.next_read()) is not None:
        first, upper, limit, max_bytes = step
        steps.append((first, limit))
        scan.feed(core.reader.read_run(SEG, first, upper, limit, max_bytes))
    assert steps == [(1, 4), (5, 4), (9, 4)]
    assert scan.result is not None and scan.result.certificate == the_certificate()
    assert scan.result.bytes_read > 0


# ---- the schedule ----


def test_the_master_s_requests_go_first_then_never_checked_then_the_oldest_check() -> None:
    a, b, c = SegmentKey(1, 1), SegmentKey(1, 2), SegmentKey(2, 1)
    sealed = {a: 5, b: 5, c: 5}
    schedule: ScrubSchedule[SegmentKey] = ScrubSchedule(1_000_000, now_ms=0, recheck_ms=1000)
    assert schedule.next_replica(0, sealed) == a  # never checked, in key order
    schedule.checked(a, 10)
    schedule.check_first(c)
    assert schedule.next_replica(20, sealed) == c  # asked for by the master
    schedule.checked(c, 30)
    assert schedule.next_replica(40, sealed) == b
    schedule.checked(b, 50)
    assert schedule.next_replica(60, sealed) is None  # each checked less than 1 s ago
    assert schedule.due_ms(sealed) == 1010
    assert schedule.next_replica(1010, sealed) == a  # checked longest ago
    assert schedule.oldest_check_age_ms(1010, sealed) == 1000
    # A replica no longer held is forgotten, with the master's request for it.
    schedule.check_first(b)
    assert schedule.next_replica(1010, {a: 5}) == a


def test_a_replica_sealed_since_the_start_is_checked_before_the_backlog() -> None:
    a, b, c, d = SegmentKey(1, 1), SegmentKey(1, 2), SegmentKey(2, 1), SegmentKey(2, 2)
    schedule: ScrubSchedule[SegmentKey] = ScrubSchedule(1_000_000, now_ms=0, recheck_ms=1000)
    assert schedule.next_replica(0, {a: 5, b: 5}) == a  # the start's backlog, in key order
    schedule.checked(a, 10)
    # d then c are sealed while b waits: the master counts them only once checked.
    assert schedule.next_replica(20, {a: 5, b: 5, d: 5}) == d
    assert schedule.next_replica(30, {a: 5, b: 5, c: 5, d: 5}) == d
    schedule.checked(d, 40)
    assert schedule.next_replica(50, {a: 5, b: 5, c: 5, d: 5}) == c
    schedule.check_first(b)
    assert schedule.next_replica(60, {a: 5, b: 5, c: 5, d: 5}) == b  # the master's ask first
    schedule.checked(b, 70)
    assert schedule.next_replica(80, {a: 5, b: 5, c: 5, d: 5}) == c
    # A fresh replica deleted before its check is forgotten.
    assert schedule.next_replica(90, {a: 5, b: 5, d: 5}) is None


def test_the_rate_spaces_the_steps() -> None:
    schedule: ScrubSchedule[SegmentKey] = ScrubSchedule(bytes_per_s=1_000_000, now_ms=0)
    assert schedule.read_at_ms() == 0
    schedule.read_done(0, 250_000)  # a quarter of a second's worth
    assert schedule.read_at_ms() == 250
    schedule.read_done(100, 500_000)  # read early: the debt adds up
    assert schedule.read_at_ms() == 750
    schedule.read_done(2000, 1000)  # after a pause nothing is owed
    assert schedule.read_at_ms() == 2001


# ---- a copy verified against the certificate ----


def test_a_copy_is_confirmed_only_when_it_makes_the_certificate() -> None:
    core = sealed_replica()
    copy_rules.verify_certificate(SEG, the_certificate(), core.reader.certify(SEG, 11))
    overwrite(core, 2, b"p9", valid_crc=True)
    with pytest.raises(CopyMismatch, match="differs from the segment's certificate"):
        copy_rules.verify_certificate(SEG, the_certificate(), core.reader.certify(SEG, 11))
    op = copy_rules.CopyOp(SEG, "source:1", 11, 4, certificate=the_certificate())
    op.start()
    op.source_state(fence=4, acked_index=11, local_fence=0)
    op.submitted(None)  # type: ignore[arg-type]  # the fence is written
    assert op.source_read_ended() == copy_rules.ReadBack(11)
    with pytest.raises(CopyMismatch):
        op.read_back(core.reader.certify(SEG, 11))
