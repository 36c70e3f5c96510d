"""Certificates of the cluster's CA revoked before they expire, and the one decision
over them: is this caller's certificate revoked.

A cluster admin revokes a certificate by serial (`streamengine cert revoke`); the master
keeps the list in its metadata (`master.catalog`), so it survives restarts and
failovers, and hands it to the stores with their registration and heartbeats (versioned
like the token revocations: the whole list when the version differs). Every server
holds its list in its `identity.ServerIdentity`, which asks `refusal` of every caller
whose certificate it verified: a revoked one is refused as a proof that does not hold
(UNAUTHENTICATED), on the master and the stores alike, streams included.

A revocation is kept until the certificate expires (after which the chain check refuses
it anyway); the list stays bounded by `REVOKED_CERTS_MAX`.

Pure: time comes in as `now_ms` (wall-clock milliseconds).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

# A cluster's CA signs a handful of certificates per host and admin; far more revoked
# at once would be a CA to replace, not to list. Bounds every reply carrying the list.
REVOKED_CERTS_MAX = 4096
# X.509 serials are positive and at most 20 bytes (RFC 5280, 4.1.2.2).
SERIAL_BITS_MAX = 160
COMMON_NAME_CHARS_MAX = 256


def serial_text(serial: int) -> str:
    """A serial as the listings show it: lowercase hex, no leading zeros."""
    return format(serial, "x")


def parse_serial(text: str) -> int:
    """A serial in hex (`1f2e...`, `0x1f2e...`, or with colons as `openssl x509 -serial`
    or browsers show it); raises ValueError."""
    digits = text.strip().lower().removeprefix("0x").replace(":", "")
    if not digits or any(c not in "0123456789abcdef" for c in digits):
        raise ValueError(f"{text!r} is not a serial number (hex digits, colons allowed)")
    serial = int(digits, 16)
    if not 0 < serial < 1 << SERIAL_BITS_MAX:
        raise ValueError(f"{text!r} is not a serial number (1 to 20 bytes)")
    return serial


@dataclass(frozen=True, slots=True)
class RevokedCert:
    serial: int
    not_after_ms: int  # when it expires anyway
    common_name: str = ""
    revoked_at_ms: int = 0

    def __post_init__(self) -> None:
        if not 0 < self.serial < 1 << SERIAL_BITS_MAX:
            raise ValueError(f"serial {self.serial} out of range")
        if len(self.common_name) > COMMON_NAME_CHARS_MAX:
            raise ValueError(f"common name of {len(self.common_name)} characters")


@dataclass(frozen=True)
class CertRevocations:
    """The revoked certificates a server refuses, by serial (at most one entry each)."""

    revoked: tuple[RevokedCert, ...] = ()
    _serials: frozenset[int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        serials = frozenset(r.serial for r in self.revoked)
        assert len(serials) == len(self.revoked), "one entry per serial"
        assert len(self.revoked) <= REVOKED_CERTS_MAX, len(self.revoked)
        object.__setattr__(self, "_serials", serials)

    @classmethod
    def of(cls, revoked: list[RevokedCert]) -> CertRevocations:
        """The list in serial order; the last entry of a serial given twice wins."""
        by_serial = {r.serial: r for r in revoked}
        return cls(tuple(by_serial[s] for s in sorted(by_serial)))

    @property
    def version(self) -> int:
        """What a store compares with its own: 0 for none, else a digest of the list."""
        if not self.revoked:
            return 0
        digest = hashlib.sha256()
        for entry in self.revoked:
            digest.update(f"{entry.serial:x}:{entry.not_after_ms}\n".encode())
        return int.from_bytes(digest.digest()[:8], "big") or 1

    def refusal(self, serial: int) -> str | None:
        """Why a caller proving the certificate `serial` is refused; None: it is not
        revoked."""
        if serial not in self._serials:
            return None
        return f"the caller's certificate (serial {serial_text(serial)}) has been revoked"

    def find(self, serial: int) -> RevokedCert | None:
        return next((r for r in self.revoked if r.serial == serial), None)

    def with_revoked(self, entry: RevokedCert) -> CertRevocations:
        """The list with `entry` added; ValueError when it would hold too many."""
        assert entry.serial not in self._serials, entry
        if len(self.revoked) >= REVOKED_CERTS_MAX:
            raise ValueError(
                f"{REVOKED_CERTS_MAX} certificates revoked already: replace the CA instead"
            )
        return CertRevocations.of([*self.revoked, entry])

    def current(self, now_ms: int) -> CertRevocations:
        """Without the certificates expired by `now_ms`: refused as expired anyway."""
        kept = [r for r in self.revoked if r.not_after_ms > now_ms]
        return self if len(kept) == len(self.revoked) else CertRevocations(tuple(kept))
