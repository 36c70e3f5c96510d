"""Tokens issued by the master: recorded, revoked, and the revocations handed out.

A section of the master's state (`master.state`); signing them is the service's.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from typing import TYPE_CHECKING

from streamengine.master.catalog import Batch
from streamengine.master.core.errors import InvalidArgument
from streamengine.master.core.model import TokenRecord, validate_name_part
from streamengine.protocol.auth import Role
from streamengine.protocol.tokens import (
    TOKEN_ID_CHARS,
    TOKEN_STREAMS_MAX,
    TOKEN_TTL_MS_DEFAULT,
    TOKEN_TTL_MS_MAX,
    TOKEN_TTL_MS_MIN,
    Revocations,
    TokenClaims,
)

if TYPE_CHECKING:
    from streamengine.master.state import MasterState

# Expired token records dropped with each token created or revoked: enough to keep up
# with any rate of creation, few enough for one metadata transaction.
EXPIRED_TOKENS_DROPPED_PER_COMMIT = 64


class TokenIssuer:
    """The records of the tokens issued, and their revocations."""

    def __init__(self, state: MasterState) -> None:
        self.state = state

    def create_token(
        self,
        token_id: str,
        tenant: str,
        role: int,
        ttl_ms: int,
        now_ms: int,
        stream_ids: Iterable[int] = (),
    ) -> TokenClaims:
        """Record a new token (the tenant created if it does not exist), limited to
        `stream_ids` when it names any; returns its claims, for the caller to sign with
        `state.keys.signing(now_ms)` at once. `token_id` is random, made by the caller."""
        validate_name_part("tenant", tenant)
        if role not in {int(r) for r in Role}:
            raise InvalidArgument(f"unknown token role {role}")
        limited = self._limited_to(tenant, role, stream_ids)
        ttl_ms = ttl_ms or TOKEN_TTL_MS_DEFAULT
        if not TOKEN_TTL_MS_MIN <= ttl_ms <= TOKEN_TTL_MS_MAX:
            raise InvalidArgument(
                f"token lifetime {ttl_ms} ms outside {TOKEN_TTL_MS_MIN}..{TOKEN_TTL_MS_MAX}"
            )
        assert len(token_id) == TOKEN_ID_CHARS and token_id not in self.state.tokens, token_id
        record = TokenRecord(token_id, tenant, role, now_ms, now_ms + ttl_ms, 0, limited)
        expired = self._expired_tokens(now_ms)
        batch = Batch().token(record)
        # The signing key verifies until its tokens expire (`core.keys`).
        key = self.state.keys.token_signed(batch, now_ms, record.expires_at_ms)
        for old in expired:
            batch.drop_token(old)
        if tenant not in self.state.tenants:
            batch.tenant(tenant, now_ms)
        self.state.catalog.commit(batch)
        self.state.keys.kept(key)
        for old in expired:
            del self.state.tokens[old]
        self.state.tenants.setdefault(tenant, now_ms)
        self.state.tokens[token_id] = record
        return TokenClaims(token_id, tenant, Role(role), now_ms, record.expires_at_ms, limited)

    def _limited_to(self, tenant: str, role: int, stream_ids: Iterable[int]) -> tuple[int, ...]:
        """The streams a new token is limited to, ascending; raises InvalidArgument
        unless each is a stream of `tenant` and the token only reads."""
        limited = tuple(sorted(set(stream_ids)))
        if not limited:
            return ()
        if role != Role.READ:
            raise InvalidArgument("only a read token is limited to streams")
        if len(limited) > TOKEN_STREAMS_MAX:
            raise InvalidArgument(f"a token is limited to at most {TOKEN_STREAMS_MAX} streams")
        unknown = [
            str(stream_id)
            for stream_id in limited
            if self.state.stream_name(stream_id).split("/", 1)[0] != tenant
        ]
        if unknown:
            raise InvalidArgument(f"no stream {', '.join(unknown)} in tenant {tenant}")
        return limited

    def revoke_token(self, token_id: str, now_ms: int) -> bool:
        """Revoke an unexpired token; False when none has this id (or it is revoked)."""
        record = self.state.tokens.get(token_id)
        if record is None or record.revoked_at_ms or record.expires_at_ms <= now_ms:
            return False
        revoked = replace(record, revoked_at_ms=now_ms)
        version = self.state.revocations.version + 1
        expired = self._expired_tokens(now_ms)
        batch = Batch().token(revoked).revocations_version(version)
        for old in expired:
            batch.drop_token(old)
        self.state.catalog.commit(batch)
        for old in expired:
            del self.state.tokens[old]
        self.state.tokens[token_id] = revoked
        self.state.revocations.replace(
            [*self.state.revocations.items(), (token_id, record.expires_at_ms)], version
        )
        return True

    def current_revocations(self, now_ms: int) -> Revocations:
        """The revocations of unexpired tokens (expired ones are refused anyway)."""
        self.state.revocations.prune(now_ms)
        return self.state.revocations

    def _expired_tokens(self, now_ms: int) -> list[str]:
        """Tokens expired by now, a bounded number (one transaction has a bound on its
        operations): refused anyway, so their records can go."""
        expired = sorted(t for t, r in self.state.tokens.items() if r.expires_at_ms <= now_ms)
        return expired[:EXPIRED_TOKENS_DROPPED_PER_COMMIT]
