"""Property-based fuzzing of what callers hand the servers' pure parts: packed entries,
signed grants and tokens. Whatever the bytes, the answer is a value or the one error
that names what is wrong (and, on a store, maps to a precise gRPC status), never
another exception; what decodes is canonical (it encodes back to the very bytes); and
what the master signs opens to what it signed.

Deterministic (`derandomize`): a failure repeats with the same examples.
"""

from __future__ import annotations

import contextlib
from typing import Any

import grpc
from hypothesis import given, settings
from hypothesis import strategies as st

from streamengine.protocol.auth import INSECURE, Principal, Role
from streamengine.protocol.entry import CorruptEntry, EntryKind, PackedEntries, StoredEntry
from streamengine.protocol.grants import (
    GRANT_SEGMENTS_MAX,
    Grant,
    GrantSegment,
    GrantSigner,
    open_grant,
)
from streamengine.protocol.limits import EPOCH_MAX, REPLICAS_MAX
from streamengine.protocol.signing import MalformedPayload, SignatureRefused, SigningKey, Verifier
from streamengine.protocol.tokens import (
    TOKEN_ID_CHARS,
    TOKEN_STREAMS_MAX,
    Revocations,
    TokenClaims,
    mint_token,
    open_token,
    resolve_caller,
)
from streamengine.segment_store.core.authority import StoreAuthority, WriteStreamGrants
from streamengine.segment_store.core.commands import SegmentKey, WriteCommand
from streamengine.segment_store.core.errors import StoreError
from streamengine.segment_store.kv import MemoryKV
from streamengine.segment_store.refusals import STATUS
from streamengine.segment_store.writes import batch_of
from streamengine.v1 import segment_store_pb2
from tests.store_commands import CommandedCore

KEY = SigningKey(bytes(range(32)))
VERIFIER = Verifier([KEY.public_key])
NOW = 1_700_000_000_000
FUZZ = settings(max_examples=150, deadline=None, derandomize=True, database=None)

names = st.text(st.characters(codec="utf-8"), min_size=1, max_size=12)
u64 = st.integers(0, (1 << 64) - 1)


def precise(error: StoreError) -> grpc.StatusCode:
    """The status a store answers `error` with (`refusals.abort`): never INTERNAL."""
    code = next((c for t, c in STATUS.items() if isinstance(error, t)), grpc.StatusCode.INTERNAL)
    assert code is not grpc.StatusCode.INTERNAL, error
    return code


@st.composite
def mutated(draw: st.DrawFn, original: bytes) -> bytes:
    """`original` with a byte flipped, cut short, grown, or spliced with bytes of its own."""
    how = draw(st.sampled_from(["flip", "cut", "insert", "splice"]))
    at = draw(st.integers(0, max(0, len(original) - 1)))
    if how == "flip":
        flipped = original[at] ^ draw(st.integers(1, 255))
        return original[:at] + bytes([flipped]) + original[at + 1 :]
    if how == "cut":
        return original[:at]
    extra = draw(st.binary(min_size=1, max_size=16))
    end = at if how == "insert" else draw(st.integers(at, len(original)))
    return original[:at] + extra + original[end:]


# ---- packed entries ----


@st.composite
def entries(draw: st.DrawFn) -> list[StoredEntry]:
    first = draw(st.integers(1, 1 << 40))
    epoch = draw(st.integers(1, EPOCH_MAX))
    payloads = draw(st.lists(st.binary(max_size=64), min_size=1, max_size=8))
    return [StoredEntry.make(first + n, EntryKind.EVENT, epoch, p) for n, p in enumerate(payloads)]


@FUZZ
@given(entries())
def test_packed_entries_round_trip_through_the_wire(made: list[StoredEntry]) -> None:
    packed, lengths = PackedEntries.of(made).to_wire()
    back = PackedEntries.from_wire(made[0].index, packed, lengths)
    assert back.entries() == made and back.check()[2] is None


@FUZZ
@given(u64, st.binary(max_size=200), st.lists(st.integers(0, 300), max_size=10))
def test_any_packed_write_is_bad_input_or_checked(
    first_index: int, packed: bytes, lengths: list[int]
) -> None:
    """What a Write carries, as a store reads it: a BadRequest (INVALID_ARGUMENT), or
    entries whose every check answers CorruptEntry or a verdict."""
    request = segment_store_pb2.WriteRequest(
        first_index=first_index, packed_values=packed, value_lengths=lengths
    )
    try:
        batch = batch_of(request)
    except StoreError as error:
        assert precise(error) is grpc.StatusCode.INVALID_ARGUMENT
        return
    try:
        batch.check()
        batch.entries()
    except CorruptEntry:
        pass


@FUZZ
@given(entries(), st.data())
def test_a_store_takes_a_mutated_batch_whole_or_refuses_it_precisely(
    made: list[StoredEntry], data: st.DataObject
) -> None:
    packed, lengths = PackedEntries.of(made).to_wire()
    garbled = data.draw(mutated(packed))
    kv = MemoryKV()
    core = CommandedCore(kv)
    segment = SegmentKey(7, made[0].epoch)
    before = kv.scan(b"", b"\xff" * 32)
    try:
        batch = PackedEntries.from_wire(made[0].index, garbled, lengths)
        core.execute(WriteCommand(segment, made[0].epoch, 0, batch, "acme"))
    except CorruptEntry:
        return
    except StoreError as error:
        precise(error)
        assert kv.scan(b"", b"\xff" * 32) == before  # refused whole


# ---- grants ----


@st.composite
def grants(draw: st.DrawFn) -> Grant:
    epoch = draw(st.integers(1, EPOCH_MAX))
    epochs = sorted(draw(st.sets(st.integers(1, epoch), max_size=GRANT_SEGMENTS_MAX)))
    copy_sets = st.lists(names, min_size=1, max_size=REPLICAS_MAX, unique=True)
    segments = tuple(GrantSegment(e, tuple(draw(copy_sets))) for e in epochs)
    return Grant(
        draw(st.integers(1, (1 << 64) - 1)),
        epoch,
        draw(names),
        draw(names),
        segments,
        draw(st.integers(1, (1 << 64) - 1)),
    )


@FUZZ
@given(grants())
def test_a_signed_grant_opens_to_what_was_signed(grant: Grant) -> None:
    assert Grant.decode(grant.encode()) == grant
    assert open_grant(VERIFIER, GrantSigner(KEY).sign(grant)) == grant


@FUZZ
@given(st.binary(max_size=300))
def test_what_decodes_as_a_grant_is_its_canonical_encoding(payload: bytes) -> None:
    try:
        grant = Grant.decode(payload)
    except MalformedPayload:
        return
    assert grant.encode() == payload


@FUZZ
@given(grants(), st.data())
def test_a_mutated_grant_is_refused_precisely_by_a_store(grant: Grant, data: st.DataObject) -> None:
    signed = GrantSigner(KEY).sign(grant)
    garbled = data.draw(mutated(signed))
    with contextlib.suppress(SignatureRefused):
        assert open_grant(VERIFIER, garbled) == grant
    authority = StoreAuthority("s1", pinned_keys=[KEY.public_key])
    segment = SegmentKey(grant.stream_id, grant.segments[-1].epoch if grant.segments else 1)
    seal = "SegmentStore/Seal"
    for admit in (
        lambda: authority.grant_for(INSECURE, seal, garbled, segment, grant.epoch, NOW),
        lambda: WriteStreamGrants(authority, INSECURE).admit(garbled, segment, grant.epoch, NOW),
    ):
        try:
            admit()
        except StoreError as error:
            assert precise(error) in (
                grpc.StatusCode.PERMISSION_DENIED,
                grpc.StatusCode.UNAVAILABLE,
            ), error


# ---- tokens ----


@st.composite
def claims(draw: st.DrawFn) -> TokenClaims:
    issued = draw(st.integers(0, 1 << 62))
    role = draw(st.sampled_from(list(Role)))
    streams = sorted(draw(st.sets(st.integers(1, (1 << 64) - 1), max_size=TOKEN_STREAMS_MAX)))
    return TokenClaims(
        draw(st.text("0123456789abcdef", min_size=TOKEN_ID_CHARS, max_size=TOKEN_ID_CHARS)),
        draw(names),
        role,
        issued,
        issued + draw(st.integers(1, 1 << 40)),
        tuple(streams),
    )


@FUZZ
@given(claims())
def test_a_minted_token_opens_to_its_claims(made: TokenClaims) -> None:
    assert TokenClaims.decode(made.encode()) == made
    assert open_token(VERIFIER, mint_token(KEY, made)) == made


@FUZZ
@given(st.binary(max_size=300))
def test_what_decodes_as_token_claims_is_their_canonical_encoding(payload: bytes) -> None:
    try:
        decoded = TokenClaims.decode(payload)
    except MalformedPayload:
        return
    assert decoded.encode() == payload


@FUZZ
@given(claims(), st.data())
def test_a_mutated_token_names_no_one_else(made: TokenClaims, data: st.DataObject) -> None:
    """A caller showing a changed token is refused (a Denial, UNAUTHENTICATED), or is
    exactly the token's principal (base64 may ignore a changed padding bit)."""
    text = mint_token(KEY, made)
    garbled = data.draw(mutated(text.encode())).decode("utf-8", "replace")
    resolved: Any = resolve_caller(INSECURE, garbled, VERIFIER, Revocations(), made.issued_at_ms)
    assert not isinstance(resolved, Principal) or resolved == made.principal()
