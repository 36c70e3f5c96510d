"""Certificates at the master (`streamengine.master.core.integrity`; docs/design.md,
"Certificates"): who may make one, when a replica is verified or bad, and how the state
records it."""

from __future__ import annotations

import pytest

from streamengine.master.core import integrity, repair
from streamengine.master.core.errors import InvalidArgument, SealConflict
from streamengine.master.core.integrity import Clean, Damaged, SegmentChecks, judge
from streamengine.master.core.model import Held, SegmentState
from streamengine.master.state import MasterState
from streamengine.protocol.certificate import Certificate, certificate_of
from streamengine.protocol.entry import EntryKind
from tests.metadata_backends import MetadataPlace
from tests.unit.lease_helpers import fixed_secrets, writer

COPY_SET = ("a", "b", "c")
W = 2


def cert(*payloads: bytes) -> Certificate:
    rows = [(i, int(EntryKind.EVENT), p) for i, p in enumerate(payloads, 1)]
    return certificate_of([*rows, (len(payloads) + 1, int(EntryKind.BRIDGE), b"")])


RIGHT = cert(b"x", b"y")
WRONG = cert(b"x", b"z")
OTHER = cert(b"q", b"y")


def run(certificate, by, reports, write_quorum=W):
    """Feed reports in order; the certificate and bad members after each."""
    checks = SegmentChecks()
    bad: set[str] = set()
    trail = []
    for now, (store, report) in enumerate(reports):
        judged = judge(certificate, by, checks, COPY_SET, write_quorum, store, report, now)
        if judged.certificate is not None:
            certificate, by = judged.certificate, integrity.REPLICAS
        bad |= set(judged.bad)
        trail.append((certificate, by, tuple(sorted(bad))))
    return trail, checks


@pytest.mark.parametrize(
    ("rule", "certificate", "by", "reports", "final_certificate", "final_bad"),
    [
        (
            "a replica matching the writer's certificate is verified",
            RIGHT,
            integrity.WRITER,
            [("a", Clean(RIGHT))],
            RIGHT,
            (),
        ),
        (
            "a replica differing from an unconfirmed writer's certificate waits",
            RIGHT,
            integrity.WRITER,
            [("a", Clean(WRONG))],
            RIGHT,
            (),
        ),
        (
            "it is condemned once another replica confirms the certificate",
            RIGHT,
            integrity.WRITER,
            [("a", Clean(WRONG)), ("b", Clean(RIGHT))],
            RIGHT,
            ("a",),
        ),
        (
            "after a confirmation a differing replica is bad at once",
            RIGHT,
            integrity.WRITER,
            [("b", Clean(RIGHT)), ("c", Clean(WRONG))],
            RIGHT,
            ("c",),
        ),
        (
            "W replicas agreeing against an unconfirmed writer's certificate replace it",
            RIGHT,
            integrity.WRITER,
            [("a", Clean(WRONG)), ("b", Clean(WRONG))],
            WRONG,
            (),
        ),
        (
            "... and a third that matched neither is then bad",
            RIGHT,
            integrity.WRITER,
            [("c", Clean(OTHER)), ("a", Clean(WRONG)), ("b", Clean(WRONG))],
            WRONG,
            ("c",),
        ),
        (
            "without a certificate W agreeing replicas make one",
            None,
            "",
            [("a", Clean(RIGHT)), ("c", Clean(WRONG)), ("b", Clean(RIGHT))],
            RIGHT,
            ("c",),
        ),
        (
            "one replica alone makes no certificate when W is 2",
            None,
            "",
            [("a", Clean(RIGHT))],
            None,
            (),
        ),
        (
            "a replica that changes its mind counts once",
            None,
            "",
            [("a", Clean(RIGHT)), ("a", Clean(WRONG)), ("b", Clean(RIGHT))],
            None,
            (),
        ),
        (
            "a replica that matched and then differs is read again, not condemned",
            RIGHT,
            integrity.WRITER,
            [("a", Clean(RIGHT)), ("a", Clean(WRONG))],
            RIGHT,
            (),
        ),
        (
            "... and condemned when it differs again",
            RIGHT,
            integrity.WRITER,
            [("a", Clean(RIGHT)), ("a", Clean(WRONG)), ("a", Clean(WRONG))],
            RIGHT,
            ("a",),
        ),
        (
            "... but not when the second read matches",
            RIGHT,
            integrity.WRITER,
            [("a", Clean(RIGHT)), ("a", Clean(WRONG)), ("a", Clean(RIGHT)), ("a", Clean(WRONG))],
            RIGHT,
            (),
        ),
        (
            "a replicas' certificate condemns a differing replica at once",
            RIGHT,
            integrity.REPLICAS,
            [("c", Clean(WRONG))],
            RIGHT,
            ("c",),
        ),
        (
            "damage is the store's to report: noted, nobody condemned here",
            RIGHT,
            integrity.REPLICAS,
            [("a", Damaged("index 2 fails its crc32c"))],
            RIGHT,
            (),
        ),
        (
            "a store outside the copy set says nothing",
            RIGHT,
            integrity.REPLICAS,
            [("x", Clean(WRONG))],
            RIGHT,
            (),
        ),
        (
            "a report up to another final index says nothing",
            RIGHT,
            integrity.REPLICAS,
            [("a", Clean(cert(b"x")))],
            RIGHT,
            (),
        ),
    ],
)
def test_judging_reports(rule, certificate, by, reports, final_certificate, final_bad) -> None:
    trail, _ = run(certificate, by, reports)
    assert trail[-1][0] == final_certificate, rule
    assert trail[-1][2] == final_bad, rule


@pytest.mark.parametrize(
    ("rule", "certificate", "by", "reports", "final_certificate", "final_bad"),
    [
        (
            "one replica, forged at rest and scrubbed first, never overturns the writer",
            RIGHT,
            integrity.WRITER,
            [("a", Clean(WRONG))],
            RIGHT,
            (),
        ),
        (
            "... and is condemned once a good one matches",
            RIGHT,
            integrity.WRITER,
            [("a", Clean(WRONG)), ("b", Clean(RIGHT))],
            RIGHT,
            ("a",),
        ),
        (
            "two replicas agreeing against the writer's certificate replace it",
            RIGHT,
            integrity.WRITER,
            [("a", Clean(WRONG)), ("b", Clean(WRONG))],
            WRONG,
            (),
        ),
        (
            "without a certificate one replica makes it, as W says",
            None,
            "",
            [("a", Clean(RIGHT))],
            RIGHT,
            (),
        ),
    ],
)
def test_judging_reports_at_w_1(rule, certificate, by, reports, final_certificate, final_bad):
    trail, _ = run(certificate, by, reports, write_quorum=1)
    assert trail[-1][0] == final_certificate, rule
    assert trail[-1][2] == final_bad, rule


def test_a_report_older_than_a_refill_in_place_has_the_replica_read_again() -> None:
    """A scrub read the forged copy; the repair refilled it in place and verified the
    copy; the scrub's report arrives after (seed 1003): its store is asked to read the
    replica again, which it does after the copy, and the replica is never bad."""
    checks = SegmentChecks()
    judge(RIGHT, integrity.WRITER, checks, COPY_SET, W, "b", Clean(RIGHT), 0)
    assert judge(RIGHT, integrity.WRITER, checks, COPY_SET, W, "a", Clean(WRONG), 1).bad == ("a",)
    assert integrity.copy_verified(checks, COPY_SET, "a", 2) == ()
    stale = judge(RIGHT, integrity.WRITER, checks, COPY_SET, W, "a", Clean(WRONG), 3)
    assert (stale.bad, stale.recheck) == ((), ("a",))
    again = judge(RIGHT, integrity.WRITER, checks, COPY_SET, W, "a", Clean(RIGHT), 4)
    assert again.bad == () and "a" in checks.verified


def test_a_verified_copy_confirms_the_writers_certificate_and_condemns_disputers() -> None:
    checks = SegmentChecks()
    judge(RIGHT, integrity.WRITER, checks, COPY_SET, W, "a", Clean(WRONG), 0)
    assert integrity.copy_verified(checks, ("d", "a", "b"), "d", 1) == ("a",)
    assert integrity.confirmed(integrity.WRITER, checks)


# ---- the state: recorded durably with the seal, judged, persisted ----

LEASE = 1000


class Master:
    def __init__(self, place: MetadataPlace) -> None:
        self.place = place
        self.now = 1_000_000
        self.state = fixed_secrets(MasterState(self.place.open(), self.now, LEASE, 3000))

    def restart(self) -> MasterState:
        self.state = fixed_secrets(MasterState(self.place.open(), self.now, LEASE, 3000))
        return self.state


@pytest.fixture
def master(metadata_place: MetadataPlace):
    """Over each metadata back end (the embedded RocksDB, etcd)."""
    m = Master(metadata_place)
    for sid in "abcd":
        m.state.registry.register_store(sid, f"127.0.0.1:{1000 + ord(sid)}", "", 0, m.now)
        m.state.registry.store_heartbeat(sid, 0, 0, {}, m.now)
    m.state.tenancy.create_stream("t/s", 3, 2, 0, 0, True, m.now)
    m.now += LEASE
    m.state.leadership.writer_heartbeat("t/s", writer("w"), 0, 0, 0, m.now)  # epoch 1
    m.state.leadership.roll_segment("t/s", writer("w"), 1, (), m.now)  # epoch 2: segment 1 to seal
    yield m


def key(m: Master):
    return (m.state.streams["t/s"].stream_id, 1)


def test_the_writers_certificate_is_recorded_with_the_seal_and_survives_a_restart(master) -> None:
    sealed = master.state.integrity.seal_segment("t/s", 1, 2, 3, master.now, RIGHT)
    assert (sealed.certificate, sealed.certified_by) == (RIGHT, integrity.WRITER)
    record = master.restart().segments[key(master)]
    assert record.state == SegmentState.SEALED
    assert (record.certificate, record.certified_by) == (RIGHT, integrity.WRITER)
    # A retried seal carries the same certificate; another one is a contradiction.
    master.state.integrity.seal_segment("t/s", 1, 2, 3, master.now, RIGHT)
    with pytest.raises(SealConflict):
        master.state.integrity.seal_segment("t/s", 1, 2, 3, master.now, WRONG)


def test_a_certificate_ending_elsewhere_than_the_final_index_is_refused(master) -> None:
    with pytest.raises(InvalidArgument):
        master.state.integrity.seal_segment("t/s", 1, 2, 4, master.now, RIGHT)
    assert master.state.segments[key(master)].state != SegmentState.SEALED


def test_replicas_certify_a_segment_sealed_without_one_and_bad_members_persist(master) -> None:
    sealed = master.state.integrity.seal_segment("t/s", 1, 2, 3, master.now)
    assert sealed.certificate is None
    members = sealed.copy_set
    state = master.state
    state.integrity.replica_reported(members[0], key(master), Clean(RIGHT), master.now)
    state.integrity.replica_reported(members[1], key(master), Clean(WRONG), master.now)
    assert state.segments[key(master)].certificate is None
    state.integrity.replica_reported(members[2], key(master), Clean(RIGHT), master.now)
    record = master.restart().segments[key(master)]
    assert (record.certificate, record.certified_by) == (RIGHT, integrity.REPLICAS)
    assert record.bad == (members[1],)
    # Repair replaces the bad member elsewhere and never copies from it.
    views = master.state.store_views(master.now)
    at_bridge = {m: Held(2, 3, 3, 10) for m in members}
    verdict = repair.judge(record, views, at_bridge, master.now, 0)
    assert verdict.bad == ((members[1], repair.BAD_COPY),)
    assert members[1] not in verdict.sources


def test_a_swap_clears_the_replaced_bad_member_and_verifies_the_target(master) -> None:
    sealed = master.state.integrity.seal_segment("t/s", 1, 2, 3, master.now, RIGHT)
    good, bad_one = sealed.copy_set[0], sealed.copy_set[1]
    target = next(s for s in "abcd" if s not in sealed.copy_set)
    master.state.integrity.replica_reported(good, key(master), Clean(RIGHT), master.now)
    master.state.integrity.replica_reported(bad_one, key(master), Clean(WRONG), master.now)
    assert master.state.segments[key(master)].bad == (bad_one,)
    swapped = master.state.replicas.swap_replica(key(master), bad_one, target, Held(2, 3, 3, 10), 1)
    assert swapped.bad == () and target in swapped.copy_set
    assert set(master.state.checks[key(master)].verified) == {good, target}


def test_a_readers_report_only_asks_the_store_to_check_first(master) -> None:
    sealed = master.state.integrity.seal_segment("t/s", 1, 2, 3, master.now, RIGHT)
    member = sealed.copy_set[0]
    address = master.state.address(member)
    assert master.state.integrity.report_replica("t/s", 1, address) == member
    assert master.state.integrity.report_replica("t/s", 1, "127.0.0.1:1") == ""
    assert master.state.segments[key(master)].bad == ()
    assert master.state.integrity.take_scrub_first(member) == [key(master)]
    assert master.state.integrity.take_scrub_first(member) == []


def test_a_segment_record_written_before_certificates_loads_without_one() -> None:
    from streamengine.master.catalog import decode_segment

    old = (
        b'{"copy_set":["a","b","c"],"created_at_ms":1,"epoch":1,"final_index":3,'
        b'"sealed_at_ms":2,"settled_at_ms":2,"state":3,"stream":"t/s","stream_id":1}'
    )
    record = decode_segment(old)
    assert (record.certificate, record.certified_by, record.bad) == (None, "", ())


def test_what_matched_the_certificate_survives_a_restart_and_keeps_it_confirmed(master) -> None:
    sealed = master.state.integrity.seal_segment("t/s", 1, 2, 3, master.now, RIGHT)
    first, second, _ = sealed.copy_set
    master.state.integrity.replica_reported(first, key(master), Clean(RIGHT), master.now)
    assert master.state.integrity.replica_verification() == (1, 2, 0)
    state = master.restart()
    assert state.segments[key(master)].verified == (first,)
    assert state.checks[key(master)].verified == {first: 0}  # when: not kept
    assert state.integrity.replica_verification() == (1, 2, 0)
    # Still confirmed: a replica that differs is condemned at once, not just noted.
    state.integrity.replica_reported(second, key(master), Clean(WRONG), master.now)
    assert state.segments[key(master)].bad == (second,)
    assert state.integrity.replica_verification() == (1, 1, 1)
    # Damage found by its store unverifies a member, durably.
    state.integrity.replica_reported(first, key(master), Damaged("crc32c at index 2"), master.now)
    assert master.restart().segments[key(master)].verified == ()


def test_a_new_incarnation_forgets_what_its_old_replicas_matched(master) -> None:
    sealed = master.state.integrity.seal_segment("t/s", 1, 2, 3, master.now, RIGHT)
    member = sealed.copy_set[0]
    address = master.state.address(member)
    master.state.registry.register_store(member, address, "", 0, master.now, incarnation=7)
    master.state.integrity.replica_reported(member, key(master), Clean(RIGHT), master.now)
    assert master.state.segments[key(master)].verified == (member,)
    registered = master.state.registry.register_store(
        member, address, "", 0, master.now, incarnation=8
    )
    assert key(master) in registered.lost
    assert master.restart().segments[key(master)].verified == ()


def test_reports_that_come_before_the_seal_are_judged_at_the_seal(master) -> None:
    """A store scrubs a replica once it is sealed there and acked up to its bridge; the
    leader seals at the master after that, so a report may come first."""
    members = master.state.segments[key(master)].copy_set
    outsider = next(s for s in "abcd" if s not in members)
    state = master.state
    state.integrity.replica_reported(members[0], key(master), Clean(RIGHT), master.now)
    state.integrity.replica_reported(members[1], key(master), Clean(WRONG), master.now)
    state.integrity.replica_reported(outsider, key(master), Clean(RIGHT), master.now)
    assert state.segments[key(master)].verified == ()
    sealed = state.integrity.seal_segment("t/s", 1, 2, 3, master.now, RIGHT)
    assert sealed.verified == (members[0],) and sealed.bad == (members[1],)
    assert state.early_reports == {}
    record = master.restart().segments[key(master)]
    assert record.verified == (members[0],) and record.bad == (members[1],)


def test_early_reports_are_bounded_and_go_with_their_segment(
    master, monkeypatch: pytest.MonkeyPatch
) -> None:
    from streamengine.master import integrity as integrity_module

    monkeypatch.setattr(integrity_module, "EARLY_REPORTS_MAX", 2)
    members = master.state.segments[key(master)].copy_set
    for member in members:
        master.state.integrity.replica_reported(member, key(master), Clean(RIGHT), master.now)
    assert list(master.state.early_reports) == [(key(master), m) for m in members[1:]]
    master.state.drop_segment(key(master))
    assert master.state.early_reports == {}
