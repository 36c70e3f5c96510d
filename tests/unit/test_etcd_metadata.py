"""The master's metadata in etcd, against a real etcd: every commit is conditional on the
master's election key and on the writer key, and a commit that fails writes nothing."""

from __future__ import annotations

import pytest

from streamengine.master import etcd_metadata
from streamengine.master.catalog import Batch, Catalog
from streamengine.master.core.errors import InvalidArgument
from streamengine.master.etcd import EtcdClient, EtcdConfig, parse_etcd_url
from streamengine.master.etcd_metadata import EtcdMetadata, MetadataChanged, NoMasterGuard
from streamengine.master.metadata import NotActive, Transaction, prefix_end
from streamengine.master.state import MasterState
from streamengine.testing import EtcdCluster
from tests.metadata_backends import EtcdPlace, join_election
from tests.unit.lease_helpers import fixed_secrets, writer

LEASE = 1000
TIMEOUT = 3000
NOW = 1_000_000


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("etcd://127.0.0.1:2379", EtcdConfig(("127.0.0.1:2379",), b"/streamengine")),
        ("etcd://a:1,b:2/", EtcdConfig(("a:1", "b:2"), b"/streamengine")),
        ("etcd://a:1,b:2,c:3/prod/se/", EtcdConfig(("a:1", "b:2", "c:3"), b"/prod/se")),
    ],
)
def test_an_etcd_url_names_members_and_a_prefix(url: str, expected: EtcdConfig) -> None:
    assert parse_etcd_url(url) == expected


@pytest.mark.parametrize(
    "url", ["etcd://", "etcd://a", "etcd://a:x", "etcd://a:1,a:1", "http://a:1", "etcd://:1"]
)
def test_a_bad_etcd_url_is_refused(url: str) -> None:
    with pytest.raises(InvalidArgument):
        parse_etcd_url(url)


def test_prefix_end_is_the_first_key_after_the_prefix() -> None:
    assert prefix_end(b"g/") == b"g0"
    assert prefix_end(b"a\xff") == b"b"
    assert prefix_end(b"/se/meta/") == b"/se/meta0"


def test_a_transaction_touching_a_key_twice_is_a_bug() -> None:
    with pytest.raises(AssertionError):
        Transaction(puts=[(b"k", b"1")], deletes=[b"k"]).check()
    with pytest.raises(AssertionError):
        Transaction(puts=[(b"g/1", b"1")], delete_prefixes=[b"g/"]).check()


@pytest.fixture
def place(session_etcd: EtcdCluster):
    place = EtcdPlace(session_etcd.endpoints[0])
    yield place
    place.close()


def records(place: EtcdPlace) -> list[tuple[bytes, bytes]]:
    """What a fresh reader of the same prefix sees."""
    metadata = EtcdMetadata(EtcdClient(parse_etcd_url(place.url)))
    try:
        return metadata.read_all()
    finally:
        metadata.close()


def test_a_deposed_master_writes_nothing_and_its_memory_does_not_move(place: EtcdPlace) -> None:
    state = fixed_secrets(MasterState(place.open(), NOW, LEASE, TIMEOUT))
    for store in ("a", "b", "c"):
        state.registry.register_store(store, f"127.0.0.1:{ord(store)}", "", 0, NOW)
    state.tenancy.create_stream("t/s", 3, 2, 0, 0, True, NOW)
    before = records(place)
    place.step_down()  # its election key is gone, as after a lease expiry

    with pytest.raises(NotActive):
        state.leadership.writer_heartbeat("t/s", writer("w1"), 0, 0, 0, NOW + LEASE)
    assert state.streams["t/s"].epoch == 0, "no epoch in memory either"
    assert state.leases["t/s"].epoch == 0
    with pytest.raises(NotActive):
        state.tenancy.create_stream("t/other", 3, 2, 0, 0, True, NOW)
    assert records(place) == before


def test_a_late_transaction_of_the_same_master_fails_instead_of_overwriting(
    place: EtcdPlace,
) -> None:
    """Two commits prepared against the same writer revision: the first applies, the
    second (a transaction etcd applies after a newer one, e.g. retried after a timeout)
    is refused and changes nothing."""
    catalog = place.open()
    assert place.metadata is not None
    guard = place.metadata.guard
    catalog.commit(Batch().tenant("t", 1))
    newer = records(place)
    place.metadata.guard = guard  # as the late transaction was built
    with pytest.raises(MetadataChanged):
        catalog.commit(Batch().tenant("t", 2))
    assert records(place) == newer


def test_a_standby_loads_what_the_active_master_wrote_and_only_it_writes(
    place: EtcdPlace,
) -> None:
    first = fixed_secrets(MasterState(place.open(), NOW, LEASE, TIMEOUT))
    for store in ("a", "b", "c"):
        first.registry.register_store(store, f"127.0.0.1:{ord(store)}", "", 0, NOW)
    first.tenancy.create_stream("t/s", 3, 2, 0, 0, True, NOW)
    granted = first.leadership.writer_heartbeat("t/s", writer("w1"), 0, 0, 0, NOW)
    assert granted.lease.epoch == 1

    # A second master on the same prefix, once the first stepped down.
    place.step_down()
    second_place = EtcdPlace(url=place.url)
    try:
        second = fixed_secrets(MasterState(second_place.open(), NOW + 10, LEASE, TIMEOUT))
        assert second.streams["t/s"].epoch == 1 and second.streams["t/s"].leader_id == "w1"
        assert not second.granting_leases(NOW + 10), "the restart rule holds after a failover"
        taken = second.leadership.writer_heartbeat("t/s", writer("w2"), 0, 0, 0, NOW + 10 + LEASE)
        assert taken.lease.epoch == 2
        with pytest.raises(NotActive):
            # A grant of the deposed master's own (its memory says the lease ran out).
            first.leadership.writer_heartbeat("t/s", writer("w3"), 0, 0, 0, NOW + 2 * LEASE)
        assert second.streams["t/s"].epoch == 2
    finally:
        second_place.close()


def test_records_load_page_by_page(place: EtcdPlace, monkeypatch: pytest.MonkeyPatch) -> None:
    catalog = place.open()
    batch = Batch()
    for number in range(25):
        batch.tenant(f"t{number:02}", number)
    catalog.commit(batch)
    # A first page of 4, then pages of about 3 records (each some 30 bytes on the wire).
    monkeypatch.setattr(etcd_metadata, "RECORDS_PER_PAGE_FIRST", 4)
    monkeypatch.setattr(etcd_metadata, "PAGE_BYTES", 100)
    assert len(catalog.load().tenants) == 25


def test_pages_are_sized_by_the_bytes_of_the_page_before() -> None:
    page_bytes = etcd_metadata.PAGE_BYTES
    assert etcd_metadata.page_records(1000 * 300, 1000) == page_bytes // 300
    assert etcd_metadata.page_records(10 * page_bytes, 1) == 1, "a record larger than a page"
    assert etcd_metadata.page_records(1000, 1000) == etcd_metadata.RECORDS_PER_PAGE_MAX


def test_a_page_too_large_for_a_message_is_read_again_smaller(
    place: EtcdPlace, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Records far larger than the ones the page size was taken from (a run of segments
    with long certificates after small records): the page etcd sends is larger than
    gRPC takes, and is read again at half the size until it fits (16, 8, then 4)."""
    monkeypatch.setattr(etcd_metadata, "RECORDS_PER_PAGE_FIRST", 16)
    catalog = place.open()
    value = b"x" * (1400 << 10)  # within etcd's 1.5 MiB a request
    for number in range(10):  # 14 MB in all, 10 MiB a message
        catalog.metadata.commit(Transaction(puts=[(f"x/{number}".encode(), value)]))
    records = catalog.metadata.read_all()
    assert [key for key, _ in records if key.startswith(b"x/")] == [
        f"x/{n}".encode() for n in range(10)
    ]


def test_a_restore_writes_only_while_no_master_is_in_the_election(place: EtcdPlace) -> None:
    catalog = place.open()
    assert place.metadata is not None
    place.metadata.guard = NoMasterGuard()
    with pytest.raises(NotActive):
        catalog.commit(Batch().tenant("t", 1))
    place.step_down()
    place.metadata.guard = NoMasterGuard()
    catalog.commit(Batch().tenant("t", 1))
    assert Catalog(place.metadata).load().tenants == {"t": 1}
    place.lease_id = join_election(place.metadata, "test-master:1")
