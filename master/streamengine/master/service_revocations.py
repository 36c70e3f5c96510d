"""The Master service's RPCs for revoked certificates: revoked and listed."""

from __future__ import annotations

from streamengine.master.core.errors import InvalidArgument
from streamengine.master.service_calls import Context, Handlers, log
from streamengine.protocol import codec
from streamengine.protocol.cert_revocations import RevokedCert
from streamengine.v1 import master_pb2


class RevocationHandlers(Handlers):
    """Certificates revoked and listed."""

    RPCS = (
        "RevokeCertificate",
        "ListRevokedCertificates",
    )

    async def RevokeCertificate(
        self, request: master_pb2.RevokeCertificateRequest, context: Context
    ) -> master_pb2.RevokeCertificateReply:
        def revoke(now: int) -> tuple[RevokedCert, bool]:
            self.calls.require(context, "RevokeCertificate")
            try:
                entry = codec.revoked_cert_from_pb(request.certificate)
            except ValueError as error:
                raise InvalidArgument(f"RevokeCertificate: {error}") from None
            return entry, self.state.revoker.revoke(entry, now)

        entry, revoked = await self.calls.call(context, "RevokeCertificate", revoke)
        log.warning(
            "certificate revoked" if revoked else "certificate revoked already",
            extra={"reason": f"serial {entry.serial:x} ({entry.common_name})"},
        )
        return master_pb2.RevokeCertificateReply(revoked=revoked)

    async def ListRevokedCertificates(
        self, request: master_pb2.ListRevokedCertificatesRequest, context: Context
    ) -> master_pb2.ListRevokedCertificatesReply:
        def listing(now: int) -> master_pb2.ListRevokedCertificatesReply:
            self.calls.require(context, "ListRevokedCertificates")
            return master_pb2.ListRevokedCertificatesReply(
                certificates=map(codec.revoked_cert_to_pb, self.state.revoker.current(now).revoked)
            )

        return await self.calls.call(context, "ListRevokedCertificates", listing)
