"""The Master service's RPCs for tokens, created (and signed here) and revoked, and for
the signing keys, rotated and listed (`master.keys`)."""

from __future__ import annotations

import secrets

from streamengine.master.core.keys import KeyRecord
from streamengine.master.service_calls import Context, Handlers, log
from streamengine.protocol.tokens import TOKEN_ID_CHARS, mint_token
from streamengine.v1 import master_pb2


class TokenHandlers(Handlers):
    """Tokens created and revoked, signing keys rotated and listed."""

    RPCS = (
        "CreateToken",
        "RevokeToken",
        "RotateSigningKey",
        "ListSigningKeys",
    )

    async def CreateToken(
        self, request: master_pb2.CreateTokenRequest, context: Context
    ) -> master_pb2.CreateTokenReply:
        def create(now: int) -> master_pb2.CreateTokenReply:
            self.calls.require(context, "CreateToken")
            token_id = secrets.token_hex(TOKEN_ID_CHARS // 2)
            while token_id in self.state.tokens:
                token_id = secrets.token_hex(TOKEN_ID_CHARS // 2)
            claims = self.state.issuer.create_token(
                token_id,
                request.tenant,
                int(request.role),
                request.ttl_ms,
                now,
                request.stream_ids,
            )
            return master_pb2.CreateTokenReply(
                token=mint_token(self.state.keys.signing(now), claims),
                token_id=claims.token_id,
                expires_at_ms=claims.expires_at_ms,
            )

        reply = await self.calls.call(context, "CreateToken", create)
        log.info(
            "token created",
            extra={"reason": f"id {reply.token_id} tenant {request.tenant} role {request.role}"},
        )
        return reply

    async def RevokeToken(
        self, request: master_pb2.RevokeTokenRequest, context: Context
    ) -> master_pb2.RevokeTokenReply:
        def revoke(now: int) -> bool:
            self.calls.require(context, "RevokeToken")
            return self.state.issuer.revoke_token(request.token_id, now)

        revoked = await self.calls.call(context, "RevokeToken", revoke)
        log.info("token revoked", extra={"reason": f"id {request.token_id}: {revoked}"})
        return master_pb2.RevokeTokenReply(revoked=revoked)

    async def RotateSigningKey(
        self, request: master_pb2.RotateSigningKeyRequest, context: Context
    ) -> master_pb2.SigningKeys:
        def rotate(now: int) -> tuple[KeyRecord, master_pb2.SigningKeys]:
            self.calls.require(context, "RotateSigningKey")
            self.state.keys.retire_due(now)
            return self.state.keys.rotate(now), self._listing(now)

        added, reply = await self.calls.call(context, "RotateSigningKey", rotate)
        log.info("signing key rotated", extra={"reason": f"key {added.key_id} signs now"})
        return reply

    async def ListSigningKeys(
        self, request: master_pb2.ListSigningKeysRequest, context: Context
    ) -> master_pb2.SigningKeys:
        def list_keys(now: int) -> master_pb2.SigningKeys:
            self.calls.require(context, "ListSigningKeys")
            self.state.keys.retire_due(now)
            return self._listing(now)

        return await self.calls.call(context, "ListSigningKeys", list_keys)

    def _listing(self, now_ms: int) -> master_pb2.SigningKeys:
        keys = self.state.keys
        return master_pb2.SigningKeys(
            keys=[
                master_pb2.SigningKeyInfo(
                    key_id=record.key_id,
                    public_key=keys.private[record.key_id].public_key,
                    created_at_ms=record.created_at_ms,
                    signing=record.signs_at(now_ms),
                    signs_from_ms=record.signs_from_ms,
                    retiring_at_ms=record.retiring_at_ms,
                )
                for record in keys.listed()
            ]
        )
