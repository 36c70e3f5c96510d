"""Event bytes that identify and verify themselves.

`writer|op|k|` + random bytes + sha256 of everything before it: every value is unique
(writer ids carry the process incarnation) and a reader can tell a corrupted payload
from an intact one without any other state.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass

DIGEST_BYTES = 32
SEPARATOR = b"|"
# A payload's fingerprint in histories: enough bits that two different values never meet.
FINGERPRINT_HEX = 16


def make(writer: str, op: int, k: int, size: int, rng: random.Random) -> bytes:
    """One payload of about `size` bytes (never below the header and digest)."""
    assert SEPARATOR.decode() not in writer, writer
    head = f"{writer}|{op}|{k}|".encode()
    body = rng.randbytes(max(0, size - len(head) - DIGEST_BYTES))
    return head + body + hashlib.sha256(head + body).digest()


def payload_id(writer: str, op: int, k: int) -> str:
    return f"{writer}|{op}|{k}"


def fingerprint(payload: bytes) -> str:
    """What histories and dumps record of a value: equal values, equal fingerprints."""
    return hashlib.sha256(payload).hexdigest()[:FINGERPRINT_HEX]


@dataclass(frozen=True, slots=True)
class Parsed:
    pid: str  # "writer|op|k", or "" when the header is unreadable
    intact: bool  # the digest matches


def parse(payload: bytes) -> Parsed:
    parts = payload.split(SEPARATOR, 3)
    if len(parts) < 4 or len(payload) < DIGEST_BYTES:
        return Parsed("", False)
    try:
        pid = SEPARATOR.join(parts[:3]).decode()
    except UnicodeDecodeError:
        pid = ""
    body, digest = payload[:-DIGEST_BYTES], payload[-DIGEST_BYTES:]
    return Parsed(pid, hashlib.sha256(body).digest() == digest)
