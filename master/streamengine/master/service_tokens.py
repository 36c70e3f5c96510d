"""The Master service's RPCs for tokens: created (and signed here) and revoked."""

from __future__ import annotations

import secrets

from streamengine.master.service_calls import Context, Handlers, log
from streamengine.protocol.tokens import TOKEN_ID_CHARS, mint_token
from streamengine.v1 import master_pb2


class TokenHandlers(Handlers):
    """Tokens created and revoked."""

    RPCS = (
        "CreateToken",
        "RevokeToken",
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
                token_id, request.tenant, int(request.role), request.ttl_ms, now
            )
            return master_pb2.CreateTokenReply(
                token=mint_token(self.state.signing_key, claims),
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
