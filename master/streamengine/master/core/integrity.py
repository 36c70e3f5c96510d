"""Certificates at the master: recording one, judging what stores report of their
replicas against it, and certifying from replicas when nobody else could. Pure.

Theory of operation. A sealed segment's certificate (`streamengine.protocol.certificate`) comes
from one of two places, and the record says which (`certified_by`):

- WRITER: the leader that sealed it knew the whole content, because it wrote every event
  itself (a roll: drain, then roll) and its recovery only added the bridge. It computed
  the certificate from the bytes it was given, before any store or disk held them, and
  sent it with SealSegment: the master records it in the same catalog write as the seal.
- REPLICAS: otherwise (a takeover's recovery, which never read the indexes below what
  every store it decided from had acked; a segment sealed before certificates existed),
  the master takes the first certificate that W replicas report identically. W copies
  written through independent disks agreeing on a SHA-256 digest do not share a flipped
  bit; and W replicas of a sealed segment hold the same content (invariant 4).

Stores report what their replicas hold (their scrub, `streamengine.segment_store.core.scrub`: the
certificate of what they read back, or damage); `judge` decides what a report means:

- a replica whose certificate equals the segment's is *verified* (with when);
- a replica that differs is *bad* once the certificate is *confirmed* (one that matched
  since it last differed is first read again, `Judgement.recheck`: a scrub that began
  before a refill in place reports what the copy replaced): made by
  replicas, or a writer's that at least one replica matched. A writer's certificate that
  no replica matched yet does not condemn anyone: if W replicas, and at least two
  (`WRITER_OVERTURNED_BY`), agree on another one, that one replaces it (the writer was
  wrong; the error is logged), so a writer's bug stalls a segment at worst, never
  condemns its good replicas, and one copy forged at rest never overturns the writer;
- damage a store found itself (a checksum, a missing index) is the store's to report:
  it reports that replica with acked index 0 and repair refills it (`repair.py`,
  "missed-bridge"); here it is only noted for status.

Bad replicas are persisted in the segment's record (`SegmentRecord.bad`): repair never
copies from them and replaces them (`repair.BAD_COPY`), readers skip them. Verified
members are persisted too (`SegmentRecord.verified`, written when the set changes, not at
every scrub), so a restarted master still knows which replicas matched and that a
writer's certificate was confirmed; when they matched, and what was proposed or
disputed, is memory only and learned again from the next scrub reports.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from streamengine.protocol.certificate import Certificate

WRITER = "writer"
REPLICAS = "replicas"
# Replicas that must agree on another certificate to overturn a writer's nobody
# confirmed, whatever W: at W=1 one copy forged at rest under a valid crc32c, scrubbed
# first, would otherwise become the segment's certificate and condemn the good ones.
WRITER_OVERTURNED_BY = 2


@dataclass(frozen=True, slots=True)
class Clean:
    """A store read its replica back: this is the certificate of what it holds."""

    certificate: Certificate


@dataclass(frozen=True, slots=True)
class Damaged:
    """A store found its replica damaged (a checksum, an index missing)."""

    detail: str


Report = Clean | Damaged


@dataclass(slots=True)
class SegmentChecks:
    """What the master learned of one sealed segment's replicas since it started."""

    # Store -> when its replica matched the certificate (the master's clock).
    verified: dict[str, int] = field(default_factory=dict)
    # Store -> root it reported that differs from an unconfirmed certificate.
    disputed: dict[str, bytes] = field(default_factory=dict)
    # Root -> (certificate, stores that reported it): certificates replicas proposed
    # while none was confirmed.
    proposals: dict[bytes, tuple[Certificate, frozenset[str]]] = field(default_factory=dict)
    # Store -> what it found damaged (status only).
    damaged: dict[str, str] = field(default_factory=dict)
    # Verified stores whose report then differed, read again before one is condemned.
    rechecking: set[str] = field(default_factory=set)

    def forget(self, store: str) -> None:
        """`store` left the copy set: nothing it said counts any more."""
        self.verified.pop(store, None)
        self.disputed.pop(store, None)
        self.damaged.pop(store, None)
        self.rechecking.discard(store)
        self.proposals = {
            root: (cert, stores - {store})
            for root, (cert, stores) in self.proposals.items()
            if stores - {store}
        }


@dataclass(frozen=True, slots=True)
class Judgement:
    """What a report changes: a certificate to record (made by replicas), members now
    bad, members to check again, and why (for the log)."""

    certificate: Certificate | None = None
    bad: tuple[str, ...] = ()
    note: str = ""
    # Members whose stores are to read their replica again before any other.
    recheck: tuple[str, ...] = ()


def confirmed(certified_by: str, checks: SegmentChecks) -> bool:
    """A certificate replicas made, or a writer's that some replica matched."""
    return certified_by == REPLICAS or bool(checks.verified)


def judge(
    certificate: Certificate | None,
    certified_by: str,
    checks: SegmentChecks,
    copy_set: tuple[str, ...],
    write_quorum: int,
    store: str,
    report: Report,
    now_ms: int,
) -> Judgement:
    """Take `store`'s report about its replica of a sealed segment (updating `checks`);
    the caller records what the judgement says. Reports from stores outside the copy
    set, or about another final index, say nothing."""
    assert 1 <= write_quorum <= len(copy_set)
    if store not in copy_set:
        return Judgement(note=f"{store} is not in the copy set")
    if isinstance(report, Damaged):
        checks.damaged[store] = report.detail
        checks.verified.pop(store, None)
        return Judgement(note=f"{store} found its replica damaged: {report.detail}")
    reported = report.certificate
    checks.damaged.pop(store, None)
    if certificate is not None and reported.final_index != certificate.final_index:
        return Judgement(note=f"{store} read up to {reported.final_index}, not the bridge")
    if certificate is not None and reported == certificate:
        checks.verified[store] = now_ms
        checks.rechecking.discard(store)
        checks.disputed.pop(store, None)
        # A confirmation: replicas that differ from it were waiting for one.
        condemned = tuple(s for s in copy_set if s in checks.disputed)
        checks.disputed.clear()
        checks.proposals.clear()
        return Judgement(bad=condemned, note=f"{store} matches the certificate")
    if certificate is not None and confirmed(certified_by, checks):
        if store in checks.verified and store not in checks.rechecking:
            # It matched since it last differed: this read may have begun before a copy
            # replaced what it read (a refill in place), its report delivered after.
            # Its store reads it again first; a second difference condemns it.
            checks.rechecking.add(store)
            note = f"{store} differs from the certificate it matched: checked again first"
            return Judgement(recheck=(store,), note=note)
        checks.verified.pop(store, None)
        checks.rechecking.discard(store)
        return Judgement(bad=(store,), note=f"{store} differs from the certificate")
    # No certificate yet, or a writer's nobody confirmed: the report is a proposal.
    return _propose(certificate, checks, copy_set, write_quorum, store, reported, now_ms)


def _propose(
    certificate: Certificate | None,
    checks: SegmentChecks,
    copy_set: tuple[str, ...],
    write_quorum: int,
    store: str,
    reported: Certificate,
    now_ms: int,
) -> Judgement:
    root = reported.root()
    checks.proposals = {
        r: (c, stores - {store}) for r, (c, stores) in checks.proposals.items() if stores - {store}
    }
    _, agreeing = checks.proposals.get(root, (reported, frozenset()))
    agreeing = agreeing | {store}
    checks.proposals[root] = (reported, agreeing)
    if certificate is not None:
        checks.disputed[store] = root
    needed = write_quorum if certificate is None else max(write_quorum, WRITER_OVERTURNED_BY)
    if len(agreeing) < needed:
        what = "disputes the writer's certificate" if certificate else "proposes a certificate"
        return Judgement(note=f"{store} {what} ({len(agreeing)} of {needed} needed agree)")
    # W replicas agree: their certificate is the segment's; the others differ from it.
    checks.verified = dict.fromkeys(sorted(agreeing), now_ms)
    others = tuple(
        s
        for s in copy_set
        if s not in agreeing
        and any(s in stores for r, (_, stores) in checks.proposals.items() if r != root)
    )
    checks.disputed.clear()
    checks.proposals.clear()
    note = f"certified by {len(agreeing)} agreeing replicas ({reported.describe()})"
    if certificate is not None:
        note = f"the writer's certificate ({certificate.describe()}) is contradicted: {note}"
    return Judgement(certificate=reported, bad=others, note=note)


def copy_verified(
    checks: SegmentChecks, copy_set: tuple[str, ...], target: str, now_ms: int
) -> tuple[str, ...]:
    """A repair's copy on `target` was verified against the certificate: a confirmation,
    as a matching report is. Returns the members it condemns (they were disputing it)."""
    checks.verified[target] = now_ms
    checks.damaged.pop(target, None)
    checks.rechecking.discard(target)
    condemned = tuple(s for s in copy_set if s in checks.disputed and s != target)
    checks.disputed.clear()
    checks.proposals.clear()
    return condemned
