"""Certificates revoked: recorded in the metadata and handed to this server's identity.

A section of the master's state (`master.state`); the list and the decision over it are
`protocol.cert_revocations`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from streamengine.master.catalog import Batch
from streamengine.master.core.errors import InvalidArgument
from streamengine.protocol import identity
from streamengine.protocol.cert_revocations import CertRevocations, RevokedCert

if TYPE_CHECKING:
    from streamengine.master.state import MasterState


class CertRevoker:
    """The revoked certificates of the active master's state."""

    def __init__(self, state: MasterState) -> None:
        self.state = state

    def revoke(self, entry: RevokedCert, now_ms: int) -> bool:
        """Revoke a certificate (`revoked_at_ms` set to `now_ms`); False when its serial
        is revoked already. Raises InvalidArgument for one expired already (its chain is
        refused anyway) or a list that is full."""
        if entry.not_after_ms <= now_ms:
            raise InvalidArgument(
                f"certificate {entry.serial:x} expired already: servers refuse it anyway"
            )
        revocations = self.current(now_ms)
        if revocations.refusal(entry.serial) is not None:
            return False
        recorded = RevokedCert(entry.serial, entry.not_after_ms, entry.common_name, now_ms)
        try:
            updated = revocations.with_revoked(recorded)
        except ValueError as error:
            raise InvalidArgument(str(error)) from None
        batch = Batch().revoked_cert(recorded)
        for gone in self.state.cert_revocations.revoked:
            if gone not in revocations.revoked:
                batch.drop_revoked_cert(gone.serial)
        self.state.catalog.commit(batch)
        self.state.cert_revocations = updated
        identity.take_revocations(updated)
        return True

    def current(self, now_ms: int) -> CertRevocations:
        """The revocations of unexpired certificates (expired ones are refused anyway)."""
        return self.state.cert_revocations.current(now_ms)
