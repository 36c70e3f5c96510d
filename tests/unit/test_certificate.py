"""Certificates of sealed segments (`streamengine.protocol.certificate`): the chunk rule, the
digests, and a reader's chunk-by-chunk check."""

from __future__ import annotations

import random

import pytest

from streamengine.protocol import certificate as cert
from streamengine.protocol.certificate import (
    Certificate,
    CertificateMismatch,
    ChunkCheck,
    ContentDigest,
    MalformedCertificate,
    certificate_of,
)
from streamengine.protocol.entry import EntryKind

EVENT, HOLE, BRIDGE = int(EntryKind.EVENT), int(EntryKind.HOLE), int(EntryKind.BRIDGE)


def content(payloads: list[bytes], holes: tuple[int, ...] = ()) -> list[tuple[int, int, bytes]]:
    """Events (HOLEs at `holes`) then the bridge."""
    rows = [
        (i, HOLE if i in holes else EVENT, b"" if i in holes else p)
        for i, p in enumerate(payloads, 1)
    ]
    return [*rows, (len(payloads) + 1, BRIDGE, b"")]


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks of at most 4 entries or 10 payload bytes: boundaries a test can count."""
    monkeypatch.setattr(cert, "CHUNK_ENTRIES_MAX", 4)
    monkeypatch.setattr(cert, "CHUNK_BYTES_MAX", 10)


@pytest.mark.usefixtures("small_chunks")
@pytest.mark.parametrize(
    ("sizes", "chunk_lasts"),
    [
        ([], [1]),  # the bridge alone
        ([1, 1], [3]),  # two events and the bridge: one chunk
        ([1, 1, 1, 1], [4, 5]),  # four entries fill a chunk; the bridge is the next
        ([1, 1, 1, 1, 1, 1, 1], [4, 8]),  # the bridge closes the second chunk
        ([10], [1, 2]),  # one event reaching the byte bound ends its chunk
        ([6, 3, 1], [3, 4]),  # 10 bytes after the third event
        ([30, 0, 0], [1, 4]),  # an event over the bound is a chunk of its own
        ([0] * 9, [4, 8, 10]),  # empty events still end chunks by count
    ],
)
def test_chunks_are_cut_by_count_bytes_and_the_final_index(
    sizes: list[int], chunk_lasts: list[int]
) -> None:
    made = certificate_of(content([b"x" * n for n in sizes]))
    assert [c.last_index for c in made.chunks] == chunk_lasts
    assert made.final_index == len(sizes) + 1


@pytest.mark.usefixtures("small_chunks")
@pytest.mark.parametrize("seed", range(20))
def test_a_writers_batched_events_make_the_certificate_entry_by_entry_does(seed: int) -> None:
    rng = random.Random(seed)
    payloads = [bytes(rng.randrange(7 if seed % 2 else 14)) for _ in range(40)]
    batched = ContentDigest()
    position = 0
    while position < len(payloads):
        size = rng.randrange(1, 9)
        batched.add_events(position + 1, payloads[position : position + size])
        position += size
    batched.add(len(payloads) + 1, BRIDGE, b"")
    assert batched.finish() == certificate_of(content(payloads))


def test_any_change_of_kind_payload_or_length_changes_the_root() -> None:
    base = content([b"ab", b"c", b""])
    root = certificate_of(base).root()
    changed = [
        [(1, EVENT, b"ax"), *base[1:]],  # a payload bit
        [base[0], (2, HOLE, b""), *base[2:]],  # a kind
        [(1, EVENT, b"a"), (2, EVENT, b"bc"), *base[2:]],  # the same bytes cut elsewhere
        [*base[:-1], (4, EVENT, b""), (5, BRIDGE, b"")],  # one more entry
    ]
    for other in changed:
        assert certificate_of(other).root() != root, other


def test_a_snapshot_is_independent_of_the_digest_it_was_taken_from() -> None:
    digest = ContentDigest()
    digest.add_events(1, [b"a", b"b"])
    snapshot = digest.copy()
    digest.add_events(3, [b"c"])
    snapshot.add(3, BRIDGE, b"")
    assert snapshot.finish() == certificate_of(content([b"a", b"b"]))
    assert digest.through_index == 3


def test_indexes_must_follow_one_another() -> None:
    digest = ContentDigest()
    with pytest.raises(ValueError, match="does not follow"):
        digest.add(2, EVENT, b"")
    with pytest.raises(MalformedCertificate):
        digest.finish()


def test_encoding_round_trips_and_malformed_certificates_are_refused() -> None:
    made = certificate_of(content([b"x" * 100] * 3))
    assert Certificate.decode(made.encode()) == made
    with pytest.raises(MalformedCertificate):
        Certificate.decode(made.encode()[:-1])
    with pytest.raises(MalformedCertificate):
        Certificate(5, (cert.Chunk(4, bytes(32)),))  # chunks end before the final index
    with pytest.raises(MalformedCertificate):
        Certificate(2, (cert.Chunk(2, bytes(31)),))


def test_real_limits_cut_a_chunk_at_its_byte_bound() -> None:
    payload = bytes(1 << 20)
    made = certificate_of(content([payload] * 5))
    # Four events of 1 MiB reach CHUNK_BYTES_MAX (4 MiB): the chunk ends after the fourth.
    assert [c.last_index for c in made.chunks] == [4, 6]


# ---- a reader's check ----


@pytest.mark.usefixtures("small_chunks")
def test_a_reader_verifies_chunk_by_chunk_and_hands_out_only_verified_indexes() -> None:
    rows = content([b"aaa", b"bb", b"c", b"dddd", b"e", b"ff"])
    made = certificate_of(rows)
    assert [c.last_index for c in made.chunks] == [4, 7]
    check = ChunkCheck(made, 1)
    kinds = [k for _, k, _ in rows]
    payloads = [p for _, _, p in rows]
    assert check.feed(1, kinds[:3], payloads[:3]) == 0  # the chunk is not complete yet
    assert check.feed(4, kinds[3:5], payloads[3:5]) == 4
    assert check.feed(6, kinds[5:], payloads[5:]) == 7
    assert check.done


@pytest.mark.usefixtures("small_chunks")
@pytest.mark.parametrize(
    ("index", "replacement"),
    [
        (2, (EVENT, b"bx")),  # a flipped payload whose crc was made valid
        (3, (HOLE, b"")),  # a stale HOLE where the final copy is an event
        (6, (EVENT, b"f")),  # a shorter payload
    ],
)
def test_a_chunk_that_differs_is_refused_before_any_of_it_is_handed_out(
    index: int, replacement: tuple[int, bytes]
) -> None:
    rows = content([b"aaa", b"bb", b"c", b"dddd", b"e", b"ff"])
    made = certificate_of(rows)
    served = list(rows)
    served[index - 1] = (index, *replacement)
    check = ChunkCheck(made, 1)
    first, last = made.chunk_of(index)
    with pytest.raises(CertificateMismatch) as refused:
        for i, kind, payload in served:
            check.feed(i, [kind], [payload])
            assert check.verified_through < first  # nothing of the bad chunk is out
    assert (refused.value.first_index, refused.value.last_index) == (first, last)


@pytest.mark.usefixtures("small_chunks")
def test_a_check_starts_at_the_chunk_of_the_position_and_skips_resent_entries() -> None:
    rows = content([b"aaa", b"bb", b"c", b"dddd", b"e", b"ff"])
    made = certificate_of(rows)
    assert ChunkCheck.start_of(made, 6) == 5
    check = ChunkCheck(made, 6)
    kinds = [k for _, k, _ in rows]
    payloads = [p for _, _, p in rows]
    assert check.feed(3, kinds[2:], payloads[2:]) == 7  # 3 and 4 precede its chunk
    with pytest.raises(CertificateMismatch, match="skipped"):
        ChunkCheck(made, 1).feed(2, kinds[1:], payloads[1:])


@pytest.mark.usefixtures("small_chunks")
def test_packed_columns_check_as_entries_do() -> None:
    rng = random.Random(3)
    payloads = [bytes(rng.randrange(256) for _ in range(rng.randrange(6))) for _ in range(30)]
    rows = content(payloads, holes=(5, 17))
    made = certificate_of(rows)
    check = ChunkCheck(made, 1)
    position = 0
    while position < len(rows):
        run = rows[position : position + rng.randrange(1, 12)]
        data = b"".join(p for _, _, p in run)
        offsets = [0]
        for _, _, p in run:
            offsets.append(offsets[-1] + len(p))
        check.feed_packed(
            run[0][0], bytes(k for _, k, _ in run), [len(p) for _, _, p in run], data, offsets
        )
        position += len(run)
    assert check.done
    tampered = list(rows)
    tampered[20] = (21, EVENT, tampered[20][2] + b"!")
    data = b"".join(p for _, _, p in tampered)
    offsets = [0]
    for _, _, p in tampered:
        offsets.append(offsets[-1] + len(p))
    with pytest.raises(CertificateMismatch):
        ChunkCheck(made, 1).feed_packed(
            1, bytes(k for _, k, _ in tampered), [len(p) for _, _, p in tampered], data, offsets
        )
