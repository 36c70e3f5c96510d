"""The store's grant decisions, what it trusts of its master, its quotas, and the
tenants its core keeps: table tests of the pure parts."""

from __future__ import annotations

import dataclasses

import pytest

from streamengine.protocol.auth import ANONYMOUS, INSECURE, Principal, PrincipalKind, Role
from streamengine.protocol.entry import EntryKind, StoredEntry
from streamengine.protocol.grants import Grant, GrantSegment, GrantSigner
from streamengine.protocol.limits import WRITE_BATCH_BYTES_MAX
from streamengine.protocol.signing import SigningKey
from streamengine.segment_store.core.authority import (
    AppendQuota,
    AuthorityRecord,
    CallerRefused,
    CallerShares,
    CallerUnproven,
    Deletion,
    GrantExpired,
    GrantRefused,
    NoSigningKeyYet,
    OverCallerLimit,
    StoreAuthority,
    StreamDeleted,
    WriteStreamGrants,
    check_grant,
)
from streamengine.segment_store.core.commands import KeepAuthorityCommand, SegmentKey, WriteCommand
from streamengine.segment_store.core.errors import BadRequest
from streamengine.segment_store.kv import MemoryKV
from tests.store_commands import CommandedCore

KEY = SigningKey(bytes(range(32)))
FORGER = SigningKey(bytes(range(100, 132)))
SIGNER = GrantSigner(KEY)
NOW = 1_700_000_000_000  # wall-clock ms

# Epoch 9 of stream 7: its own segment on s1..s3, and two earlier segments still to seal
# on other copy sets (a new leader seals segments whose copy sets differ from its own).
GRANT = Grant(
    stream_id=7,
    epoch=9,
    tenant="acme",
    client_id="w1",
    segments=(
        GrantSegment(5, ("s4", "s5", "s6")),
        GrantSegment(8, ("s3", "s4", "s5")),
        GrantSegment(9, ("s1", "s2", "s3")),
    ),
    expires_at_ms=NOW + 60_000,
)


@pytest.mark.parametrize(
    ("store", "segment", "epoch", "refusal"),
    [
        ("s1", SegmentKey(7, 9), 9, None),  # its own segment
        ("s5", SegmentKey(7, 5), 9, None),  # an earlier one, by that one's copy set
        ("s3", SegmentKey(7, 8), 9, None),
        ("s1", SegmentKey(7, 8), 9, "not in the copy set of segment 8"),
        ("s6", SegmentKey(7, 9), 9, "not in the copy set of segment 9"),
        ("s1", SegmentKey(7, 7), 9, "does not list segment 7"),  # sealed already
        ("s1", SegmentKey(7, 9), 10, "not of epoch 10"),  # someone else's epoch
        ("s1", SegmentKey(7, 9), 8, "not of epoch 8"),
        ("s1", SegmentKey(8, 9), 9, "not of stream 8"),
        ("s1", SegmentKey(7, (1 << 31) - 1), (1 << 31) - 1, "not of epoch"),
    ],
)
def test_check_grant(store: str, segment: SegmentKey, epoch: int, refusal: str | None) -> None:
    if refusal is None:
        check_grant(GRANT, store, segment, epoch, NOW)
        return
    with pytest.raises(GrantRefused, match=refusal):
        check_grant(GRANT, store, segment, epoch, NOW)


WRITER = Principal(PrincipalKind.TENANT, "tok", tenant="acme", role=Role.WRITE, token_id="a" * 16)
READER = Principal(PrincipalKind.TENANT, "tok", tenant="acme", role=Role.READ, token_id="b" * 16)
OTHER_WRITER = Principal(
    PrincipalKind.TENANT, "tok2", tenant="acme", role=Role.WRITE, token_id="d" * 16
)
OTHER_TENANT = Principal(
    PrincipalKind.TENANT, "tok", tenant="evil", role=Role.ADMIN, token_id="c" * 16
)
MEMBER = Principal(PrincipalKind.STORE, "s2")


def authority(store: str = "s1") -> StoreAuthority:
    return StoreAuthority(store, AuthorityRecord((KEY.public_key,)))


@pytest.mark.parametrize(
    ("principal", "signed", "error"),
    [
        (INSECURE, SIGNER.sign(GRANT), None),
        (WRITER, SIGNER.sign(GRANT), None),
        (INSECURE, b"", GrantRefused),  # no grant: refused, whoever calls
        (INSECURE, GrantSigner(FORGER).sign(GRANT), GrantRefused),
        (INSECURE, SIGNER.sign(GRANT)[:-1] + b"\0", GrantRefused),
        (READER, SIGNER.sign(GRANT), CallerRefused),  # a read token cannot write
        (OTHER_TENANT, SIGNER.sign(GRANT), CallerRefused),
        (MEMBER, SIGNER.sign(GRANT), CallerRefused),  # members never write
    ],
)
def test_a_seal_needs_a_valid_grant_and_a_caller_allowed_to_use_it(
    principal: Principal, signed: bytes, error: type[Exception] | None
) -> None:
    checks = authority("s3")  # in the copy set of segment 8, the one sealed
    if error is None:
        assert checks.grant_for(principal, "SegmentStore/Seal", signed, SegmentKey(7, 8), 9, NOW)
        return
    with pytest.raises(error):
        checks.grant_for(principal, "SegmentStore/Seal", signed, SegmentKey(7, 8), 9, NOW)


def test_a_store_without_its_masters_key_cannot_tell_yet() -> None:
    with pytest.raises(NoSigningKeyYet):
        StoreAuthority("s1").open_grant(SIGNER.sign(GRANT))


def test_a_write_stream_shows_a_grant_once_and_only_for_what_it_lists() -> None:
    grants = WriteStreamGrants(authority("s3"), INSECURE)
    with pytest.raises(GrantRefused, match="no grant of epoch 9"):
        grants.admit(b"", SegmentKey(7, 9), 9, NOW)
    assert grants.admit(SIGNER.sign(GRANT), SegmentKey(7, 9), 9, NOW) == GRANT
    assert grants.admit(b"", SegmentKey(7, 9), 9, NOW) == GRANT  # later requests go without
    assert grants.admit(b"", SegmentKey(7, 8), 9, NOW) == GRANT  # a recovery write it lists
    with pytest.raises(GrantRefused):
        grants.admit(b"", SegmentKey(7, 5), 9, NOW)  # s3 is not in segment 5's copy set
    with pytest.raises(GrantRefused, match="no grant of epoch 10"):
        grants.admit(b"", SegmentKey(7, 10), 10, NOW)
    # Another stream of the same store knows nothing of this one's grants.
    with pytest.raises(GrantRefused):
        WriteStreamGrants(authority("s3"), INSECURE).admit(b"", SegmentKey(7, 9), 9, NOW)


def test_an_expired_grant_is_refused_shown_fresh_or_kept_from_earlier() -> None:
    grants = WriteStreamGrants(authority("s1"), INSECURE)
    expires = GRANT.expires_at_ms
    assert grants.admit(SIGNER.sign(GRANT), SegmentKey(7, 9), 9, expires - 1) == GRANT
    with pytest.raises(GrantExpired, match=f"expired at {expires} .* renews it with its lease"):
        grants.admit(b"", SegmentKey(7, 9), 9, expires)
    with pytest.raises(GrantExpired):
        grants.admit(SIGNER.sign(GRANT), SegmentKey(7, 9), 9, expires)
    with pytest.raises(GrantExpired):
        authority("s1").grant_for(INSECURE, "SegmentStore/Seal", SIGNER.sign(GRANT),
                                  SegmentKey(7, 9), 9, expires + 1)
    # A renewed grant shown on the same stream takes over from the expired one.
    renewed = dataclasses.replace(GRANT, expires_at_ms=expires + 60_000)
    assert grants.admit(SIGNER.sign(renewed), SegmentKey(7, 9), 9, expires) == renewed
    assert grants.admit(b"", SegmentKey(7, 9), 9, expires + 1) == renewed


def test_a_write_stream_of_a_read_token_is_refused_at_its_first_grant() -> None:
    grants = WriteStreamGrants(authority(), READER)
    with pytest.raises(CallerRefused):
        grants.admit(SIGNER.sign(GRANT), SegmentKey(7, 9), 9, NOW)
    with pytest.raises(GrantRefused):
        grants.admit(b"", SegmentKey(7, 9), 9, NOW)  # nothing was kept of the refused grant


def test_a_write_stream_opened_under_a_token_revoked_since_is_refused() -> None:
    """A streaming call proves its caller once, when it opens: a revocation the store
    hears of afterwards refuses the stream's next request, with or without a grant."""
    checks = authority("s1")
    grants = WriteStreamGrants(checks, WRITER)
    others = WriteStreamGrants(checks, OTHER_WRITER)
    assert grants.admit(SIGNER.sign(GRANT), SegmentKey(7, 9), 9, NOW) == GRANT
    assert others.admit(SIGNER.sign(GRANT), SegmentKey(7, 9), 9, NOW) == GRANT
    assert checks.update([KEY.public_key], 1, [(WRITER.token_id, NOW + 60_000)], NOW)
    with pytest.raises(CallerUnproven, match="was revoked"):
        grants.admit(b"", SegmentKey(7, 9), 9, NOW)
    with pytest.raises(CallerUnproven, match="was revoked"):
        grants.admit(SIGNER.sign(GRANT), SegmentKey(7, 9), 9, NOW)
    # Another token of the same tenant goes on.
    assert others.admit(b"", SegmentKey(7, 9), 9, NOW) == GRANT


def test_what_the_master_says_replaces_what_was_kept_and_survives_encoding() -> None:
    checks = StoreAuthority("s1")
    assert checks.update([KEY.public_key], 3, [("a" * 16, 5_000), ("b" * 16, 900)], 1_000)
    assert checks.revocations.items() == [("a" * 16, 5_000)]  # b expired already
    record = checks.record()
    assert AuthorityRecord.decode(record.encode()) == record
    again = StoreAuthority("s1", AuthorityRecord.decode(record.encode()))
    assert again.open_grant(SIGNER.sign(GRANT)) == GRANT
    assert "a" * 16 in again.revocations and again.revocations.version == 3
    # The same version with no list: nothing to take.
    assert not again.update([KEY.public_key], 3, None, 1_000)
    # A new version replaces the list, even with an empty one.
    assert again.update([KEY.public_key], 4, [], 1_000)
    assert len(again.revocations) == 0


def test_a_pinned_key_is_trusted_beside_the_masters_and_never_replaced() -> None:
    checks = StoreAuthority("s1", pinned_keys=[FORGER.public_key])
    assert checks.open_grant(GrantSigner(FORGER).sign(GRANT)) == GRANT
    checks.update([KEY.public_key], 0, None, 0)
    assert checks.open_grant(GrantSigner(FORGER).sign(GRANT)) == GRANT
    assert checks.open_grant(SIGNER.sign(GRANT)) == GRANT
    assert checks.record().master_keys == (KEY.public_key,)


def test_a_key_the_master_dropped_is_refused_at_once() -> None:
    checks = authority()
    signed = SIGNER.sign(GRANT)
    assert checks.open_grant(signed) == GRANT
    checks.update([FORGER.public_key], 0, None, 0)
    with pytest.raises(GrantRefused):
        checks.open_grant(signed)


@pytest.mark.parametrize(
    ("rate", "batches", "admitted"),
    [
        (0, [(0, 10**9)] * 3, [True, True, True]),  # no limit
        # A second of the rate may go at once; then nothing until the bucket refills,
        # at the rate (8 KiB in a millisecond here).
        (WRITE_BATCH_BYTES_MAX, [(0, WRITE_BATCH_BYTES_MAX), (0, 1), (1, 1)], [True, False, True]),
        # A batch larger than what is left goes into debt, and the next one waits until
        # the debt is paid back: at 1000 bytes/s, 90 bytes take 90 ms.
        (1000, [(0, 990), (0, 100), (0, 1), (89, 1), (91, 1)], [True, True, False, False, True]),
        # A batch larger than the whole bucket passes when it is full, and the rate holds
        # on average: at 1000 bytes/s, the next batch waits for its bytes to be paid.
        (
            1000,
            [(0, WRITE_BATCH_BYTES_MAX), (1000, 1), (WRITE_BATCH_BYTES_MAX, 1)],
            [True, False, True],
        ),
    ],
)
def test_append_quota(rate: int, batches: list[tuple[int, int]], admitted: list[bool]) -> None:
    quota = AppendQuota(rate)
    assert [quota.admit("acme", size, at) for at, size in batches] == admitted


def test_each_tenant_has_its_own_append_budget() -> None:
    quota = AppendQuota(WRITE_BATCH_BYTES_MAX)
    assert quota.admit("acme", WRITE_BATCH_BYTES_MAX, 0)
    assert not quota.admit("acme", 1, 0)
    assert quota.admit("other", 1, 0)


# ---- the core keeps each stream's tenant ----


def event(index: int) -> StoredEntry:
    return StoredEntry.make(index, EntryKind.EVENT, 9, b"x")


def test_the_core_keeps_the_tenant_of_a_stream_across_restarts() -> None:
    kv = MemoryKV()
    core = CommandedCore(kv)
    assert core.catalog.tenant_of(7) == ""
    core.execute(WriteCommand.of(SegmentKey(7, 9), 9, 0, (event(1),), "acme"))
    assert core.catalog.tenant_of(7) == "acme"
    core.seal(SegmentKey(7, 8), 9)  # a command that names no tenant changes none
    assert CommandedCore(kv).catalog.tenant_of(7) == "acme"


def test_a_command_naming_another_tenant_for_a_stream_is_refused_whole() -> None:
    kv = MemoryKV()
    core = CommandedCore(kv)
    core.execute(WriteCommand.of(SegmentKey(7, 9), 9, 0, (event(1),), "acme"))
    with pytest.raises(BadRequest, match="tenant"):
        core.execute(WriteCommand.of(SegmentKey(7, 9), 9, 0, (event(2),), "evil"))
    meta = core.catalog.meta(SegmentKey(7, 9))
    assert meta is not None and meta.last_index == 1 and core.catalog.tenant_of(7) == "acme"


def test_the_core_keeps_the_authority_record() -> None:
    kv = MemoryKV()
    record = AuthorityRecord((KEY.public_key,), 2, (("a" * 16, 10),)).encode()
    CommandedCore(kv).execute(KeepAuthorityCommand(record))
    assert CommandedCore(kv).catalog.authority_record() == record


def test_a_stream_the_master_lists_as_deleted_is_refused_until_it_is_listed_no_more() -> None:
    checks = StoreAuthority("s1")
    checks.check_not_deleted(7)
    checks.deleted_streams = {7: Deletion(123_000, fenced_through_epoch=4)}
    with pytest.raises(StreamDeleted) as refused:
        checks.check_not_deleted(7)
    assert refused.value.deleted_until_ms == 123_000
    checks.check_not_deleted(8)
    checks.deleted_streams = {}
    checks.check_not_deleted(7)


@pytest.mark.parametrize(
    ("rule", "fenced_through_epoch", "writer_epoch", "admitted"),
    [
        ("an epoch granted before the delete is refused", 4, 4, False),
        ("an earlier epoch is refused", 4, 2, False),
        ("an epoch granted after an undelete writes at once", 4, 5, True),
        ("a master that does not name the epoch: every epoch refused", 0, 5, False),
    ],
)
def test_a_write_to_a_stream_listed_as_deleted_goes_on_only_under_a_later_epoch(
    rule: str, fenced_through_epoch: int, writer_epoch: int, admitted: bool
) -> None:
    checks = StoreAuthority("s1")
    checks.deleted_streams = {7: Deletion(123_000, fenced_through_epoch)}
    if admitted:
        checks.check_not_deleted(7, writer_epoch)
    else:
        with pytest.raises(StreamDeleted):
            checks.check_not_deleted(7, writer_epoch)
    with pytest.raises(StreamDeleted):  # a live tail has no epoch: refused until listed no more
        checks.check_not_deleted(7)


# ---- each caller's share of the store ----

READER = Principal(PrincipalKind.TENANT, "r", "acme", Role.READ, "t-read")
WRITER = Principal(PrincipalKind.TENANT, "w", "acme", Role.WRITE, "t-write")


def test_an_anonymous_stream_is_refused_at_open_and_holds_nothing() -> None:
    shares = CallerShares(1000)
    with pytest.raises(CallerUnproven, match="certificate proof or a token"):
        shares.open_stream(ANONYMOUS)
    assert shares.streams(ANONYMOUS) == 0


def test_each_principal_holds_at_most_its_streams_while_others_still_open() -> None:
    shares = CallerShares(1000, streams_max=3)
    for _ in range(3):
        shares.open_stream(READER)
    with pytest.raises(OverCallerLimit, match="STREAMS_PER_PRINCIPAL_MAX 3"):
        shares.open_stream(READER)
    shares.open_stream(WRITER)  # another token of the same tenant is another principal
    shares.close_stream(READER)
    shares.open_stream(READER)
    assert (shares.streams(READER), shares.streams(WRITER)) == (3, 1)
    for _ in range(3):
        shares.close_stream(READER)
    assert shares.streams(READER) == 0


def test_a_store_without_certificates_counts_and_refuses_no_one() -> None:
    shares = CallerShares(1000, streams_max=1)
    for _ in range(5):
        shares.open_stream(INSECURE)
        assert shares.take_queue_bytes(INSECURE, 10_000)
    shares.close_stream(INSECURE)
    shares.give_queue_bytes(INSECURE, 10_000)
    assert shares.streams(INSECURE) == 0


def test_one_principal_fills_at_most_its_share_of_the_write_queue() -> None:
    shares = CallerShares(4000)  # a quarter each: 1000 bytes
    assert shares.queue_bytes_max == 1000
    assert shares.take_queue_bytes(WRITER, 600)
    assert shares.take_queue_bytes(WRITER, 400)
    assert not shares.take_queue_bytes(WRITER, 1)
    assert shares.take_queue_bytes(READER, 1000)  # another principal's own share
    shares.give_queue_bytes(WRITER, 600)
    assert shares.take_queue_bytes(WRITER, 600)
    assert shares.queued_bytes(WRITER) == 1000


def test_a_batch_larger_than_the_share_passes_alone() -> None:
    shares = CallerShares(4000)
    assert shares.take_queue_bytes(WRITER, 5000)
    assert not shares.take_queue_bytes(WRITER, 1)
    shares.give_queue_bytes(WRITER, 5000)
    assert shares.queued_bytes(WRITER) == 0


def test_a_batch_without_payload_counts_nothing_whenever_its_answer_comes() -> None:
    """A recovery's holes and bridge carry no payload. Counted as 0, the give of another
    batch answered first dropped the entry, and the empty batch's own give then raised
    KeyError in the store's write path (the fault suite's S17 on TLS)."""
    shares = CallerShares(4000)
    assert shares.take_queue_bytes(WRITER, 0)
    assert shares.take_queue_bytes(WRITER, 500)
    shares.give_queue_bytes(WRITER, 500)
    shares.give_queue_bytes(WRITER, 0)
    assert shares.queued_bytes(WRITER) == 0
    assert shares.take_queue_bytes(WRITER, 1000)  # the whole share is free again
