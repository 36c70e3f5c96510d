"""`streamengine verify NAME`: every replica of every sealed segment read back against its
certificate."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc

from streamengine.protocol.clock import wall_ms
from streamengine.protocol.transport import PLAINTEXT, Transport
from streamengine.v1 import entry_pb2, master_pb2, segment_store_pb2
from streamengine.v1 import segment_store_pb2_grpc as store_grpc

if TYPE_CHECKING:
    pass
from streamengine.tools.ops import RPC_TIMEOUT_S, client_transport, master_stub


def digest_of(
    address: str,
    segment: entry_pb2.SegmentId,
    up_to: int,
    transport: Transport = PLAINTEXT,
    certificate: bool = False,
) -> segment_store_pb2.DigestReply:
    with transport.channel(address) as channel:
        return store_grpc.SegmentStoreStub(channel).Digest(
            segment_store_pb2.DigestRequest(
                segment=segment, up_to_index=up_to, certificate=certificate
            ),
            timeout=RPC_TIMEOUT_S,
        )


@dataclass(frozen=True)
class VerifyReport:
    sealed_segments: int
    problems: list[str]
    # What was found, a line per segment and per replica (the certificate and each
    # replica's state), for the operator.
    lines: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def verify_stream(master_address: str, name: str, transport: Transport = PLAINTEXT) -> VerifyReport:
    """Read every replica of every sealed segment of `name` back up to its bridge and
    compare it with the segment's certificate (with the other replicas for a segment
    the master holds no certificate of yet)."""
    with master_stub(master_address, transport) as master:
        listing = master.ListSegments(
            master_pb2.ListSegmentsRequest(stream=name, certificates=True),
            timeout=RPC_TIMEOUT_S,
        )
    problems: list[str] = []
    lines: list[str] = []
    checked = 0
    now_ms = wall_ms()
    for segment in listing.segments:
        if segment.state != entry_pb2.SEALED:
            continue
        checked += 1
        segment_id = entry_pb2.SegmentId(
            stream_id=listing.stream_id, epoch=segment.id.epoch, stream=name
        )
        _verify_segment(segment, segment_id, transport, now_ms, problems, lines)
    return VerifyReport(checked, problems, lines)


def _verify_segment(
    segment: entry_pb2.Segment,
    segment_id: entry_pb2.SegmentId,
    transport: Transport,
    now_ms: int,
    problems: list[str],
    lines: list[str],
) -> None:
    epoch, final = segment.id.epoch, segment.final_index
    certified = segment.HasField("certificate")
    root = segment.certificate.root
    if certified:
        chunks = len(segment.certificate.chunks)
        lines.append(
            f"segment {epoch}: final {final}, certificate {root.hex()[:16]} "
            f"({segment.certificate.certified_by or '?'}, {chunks} chunk(s))"
        )
    else:
        lines.append(f"segment {epoch}: final {final}, no certificate yet (replicas compared)")
    verified = {v.store_id: v.verified_at_ms for v in segment.verified}
    bad = set(segment.bad_stores)
    roots: dict[str, bytes] = {}
    for replica in segment.copy_set:
        store = replica.store_id
        master_view = _master_view(store, verified, bad, now_ms)
        try:
            reply = digest_of(replica.address, segment_id, final, transport, certificate=True)
        except grpc.RpcError as error:
            code = error.code().name
            problems.append(f"segment {epoch}: replica {store} missing ({code})")
            lines.append(f"  {store}: {code} {error.details() or ''}{master_view}")
            continue
        state = _replica_state(reply, final, root if certified else b"")
        lines.append(f"  {store}: {state}{master_view}")
        if reply.acked_index < final:
            problems.append(
                f"segment {epoch}: replica {store} acked only to "
                f"{reply.acked_index} of {final} (missed the bridge)"
            )
        elif not reply.HasField("certificate"):
            problems.append(f"segment {epoch}: replica {store} {state}")
        elif certified and reply.certificate.root != root:
            problems.append(f"segment {epoch}: replica {store} differs from the certificate")
        roots[store] = reply.certificate.root
    if not certified and len(set(roots.values())) > 1:
        detail = ", ".join(f"{s}={d.hex()[:12]}" for s, d in sorted(roots.items()))
        problems.append(f"segment {epoch}: replicas differ: {detail}")


def _replica_state(reply: segment_store_pb2.DigestReply, final: int, root: bytes) -> str:
    if not reply.HasField("certificate"):
        return f"lacks index {reply.entries_held + 1} (holds {reply.entries_held} of {final})"
    mine = reply.certificate.root
    if not root:
        return f"holds {mine.hex()[:16]}"
    return "matches the certificate" if mine == root else f"DIFFERS: holds {mine.hex()[:16]}"


def _master_view(store: str, verified: dict[str, int], bad: set[str], now_ms: int) -> str:
    if store in bad:
        return "; the master lists it bad"
    if store in verified and not verified[store]:
        return "; matched before the master last started"
    if store in verified:
        ago = max(0, now_ms - verified[store]) / 1000
        return f"; matched {ago:.0f} s ago"
    return "; not matched yet"


def cmd_verify(args: argparse.Namespace) -> int:
    """Read every replica of every sealed segment back against its certificate; exit 1
    on a difference or a missing replica."""
    report = verify_stream(args.master, args.name, client_transport(args))
    for line in report.lines:
        print(line)
    for problem in report.problems:
        print(problem)
    verdict = "OK" if report.ok else f"{len(report.problems)} problem(s)"
    print(f"verify {args.name}: {report.sealed_segments} sealed segments checked, {verdict}")
    return 0 if report.ok else 1


# ---- data: append and tail ----
