"""Tenant tokens, and who a call comes from.

A token is the master's signed word (`protocol.signing`) that its bearer may act in
one tenant with one role until a time, on all the tenant's streams or only on some
(`stream_ids`, by id: a stream deleted and made again under its name is another
stream): `TokenClaims`. A token limited to streams only reads them (the master makes
no other), for a job's executors that need nothing more (`client.spark`). A cluster
admin creates one (`streamengine token create`); the master keeps a record of it so
that it can be revoked, and stores verify tokens without asking anyone, with the
master's public key.
Revocations reach stores with their heartbeats (`Revocations`, versioned); a revoked
token is refused until it would have expired anyway, after which it is refused as
expired and the revocation is forgotten.

Text form: `se1_` then the envelope in URL-safe base64 without padding, sent as
`authorization: Bearer <token>` request metadata. Envelopes of magic `SET2` carry the
stream ids after the claims; `SET1` ones (made before tokens could be limited) carry
none and still verify, for the tenant's every stream.

Who calls (`resolve_caller`): a certificate naming a cluster member or a cluster admin
proves more than a token, and wins. Otherwise a token, when the call carries one, must
be valid, unexpired and unrevoked, and then names the caller; a call without one stays
what its transport made it: ANONYMOUS over TLS, INSECURE over plaintext (loopback or
--insecure: everything is allowed, as before security existed). A plaintext server
still holds a caller who shows a token to it: a token only ever narrows what a call may
do.

Pure: time comes in as `now_ms` (wall-clock milliseconds: tokens outlive processes).
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from streamengine.protocol.auth import (
    Denial,
    Principal,
    PrincipalKind,
    Role,
)
from streamengine.protocol.signing import (
    ENVELOPE_BYTES_MAX,
    KEY_ID_BYTES,
    MAGIC_BYTES,
    SIGNATURE_BYTES,
    MalformedPayload,
    NoVerifyingKey,
    PayloadReader,
    PayloadWriter,
    SignatureRefused,
    SigningKey,
    Verifier,
)

TOKEN_MAGIC = b"SET2"
TOKEN_MAGIC_UNLIMITED = b"SET1"  # tokens made before a token could name streams
# Streams one token may be limited to: a job reads a few; the envelope stays small
# (`signing.ENVELOPE_BYTES_MAX`).
TOKEN_STREAMS_MAX = 64
TOKEN_PREFIX = "se1_"
TOKEN_CHARS_MAX = len(TOKEN_PREFIX) + (ENVELOPE_BYTES_MAX * 4 + 2) // 3
TOKEN_ID_CHARS = 16  # 8 random bytes, hex

# Lifetimes. A token always expires, so a revocation is kept only until then and the
# list stores hold stays bounded.
TOKEN_TTL_MS_DEFAULT = 24 * 3600 * 1000
TOKEN_TTL_MS_MAX = 366 * 24 * 3600 * 1000
TOKEN_TTL_MS_MIN = 1000


@dataclass(frozen=True, slots=True)
class TokenClaims:
    token_id: str
    tenant: str
    role: Role
    issued_at_ms: int
    expires_at_ms: int
    # The streams it is limited to, ascending; empty: every stream of the tenant.
    stream_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        assert len(self.token_id) == TOKEN_ID_CHARS, self
        assert self.tenant and self.issued_at_ms < self.expires_at_ms, self
        assert len(self.stream_ids) <= TOKEN_STREAMS_MAX, self
        assert list(self.stream_ids) == sorted(set(self.stream_ids)) and 0 not in self.stream_ids

    def encode(self) -> bytes:
        out = PayloadWriter().text(self.token_id).text(self.tenant).u8(int(self.role))
        out.u64(self.issued_at_ms).u64(self.expires_at_ms).u8(len(self.stream_ids))
        for stream_id in self.stream_ids:
            out.u64(stream_id)
        return out.bytes()

    @classmethod
    def decode(cls, payload: bytes) -> TokenClaims:
        """The claims of a `TOKEN_MAGIC` envelope; raises MalformedPayload."""
        return cls._decode(payload, limited=True)

    @classmethod
    def decode_unlimited(cls, payload: bytes) -> TokenClaims:
        """The claims of a `TOKEN_MAGIC_UNLIMITED` envelope; raises MalformedPayload."""
        return cls._decode(payload, limited=False)

    @classmethod
    def _decode(cls, payload: bytes, limited: bool) -> TokenClaims:
        reader = PayloadReader(payload)
        token_id, tenant, role = reader.text(), reader.text(), reader.u8()
        issued_at_ms, expires_at_ms = reader.u64(), reader.u64()
        stream_ids: tuple[int, ...] = ()
        if limited:
            count = reader.u8()
            if count > TOKEN_STREAMS_MAX:
                raise MalformedPayload(f"a token limited to {count} streams")
            stream_ids = tuple(reader.u64() for _ in range(count))
        reader.finish()
        if len(token_id) != TOKEN_ID_CHARS or not tenant or issued_at_ms >= expires_at_ms:
            raise MalformedPayload("token claims without an id, a tenant or a lifetime")
        if role not in {int(r) for r in Role}:
            raise MalformedPayload(f"unknown role {role}")
        if list(stream_ids) != sorted(set(stream_ids)) or 0 in stream_ids:
            raise MalformedPayload("a token's streams out of order, twice, or 0")
        return cls(token_id, tenant, Role(role), issued_at_ms, expires_at_ms, stream_ids)

    def principal(self) -> Principal:
        return Principal(
            PrincipalKind.TENANT,
            f"token {self.token_id}",
            tenant=self.tenant,
            role=self.role,
            token_id=self.token_id,
            stream_ids=self.stream_ids,
        )


def mint_token(key: SigningKey, claims: TokenClaims) -> str:
    return token_text(key.sign(TOKEN_MAGIC, claims.encode()))


def token_text(envelope: bytes) -> str:
    """The text a bearer carries for `envelope`: the prefix, then unpadded base64."""
    return TOKEN_PREFIX + base64.urlsafe_b64encode(envelope).rstrip(b"=").decode("ascii")


def token_envelope(token: str) -> bytes:
    """The signed envelope inside a token's text (not yet verified); raises
    SignatureRefused for text of no token's format."""
    if not token.startswith(TOKEN_PREFIX) or len(token) > TOKEN_CHARS_MAX:
        raise SignatureRefused("not a token of this cluster's format")
    text = token[len(TOKEN_PREFIX) :]
    try:
        return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except (binascii.Error, ValueError):
        raise SignatureRefused("a token that is not base64") from None


def open_token(verifier: Verifier, token: str) -> TokenClaims:
    """The claims of a token that verifies; raises SignatureRefused (NoVerifyingKey when
    the verifier holds no key yet). Says nothing of expiry or revocation."""
    envelope = token_envelope(token)
    try:
        if envelope[: len(TOKEN_MAGIC_UNLIMITED)] == TOKEN_MAGIC_UNLIMITED:
            return verifier.open(TOKEN_MAGIC_UNLIMITED, envelope, TokenClaims.decode_unlimited)
        return verifier.open(TOKEN_MAGIC, envelope, TokenClaims.decode)
    except MalformedPayload as error:
        raise SignatureRefused(f"malformed token claims: {error}") from None


def unverified_claims(token: str) -> TokenClaims:
    """What a token says of itself, its signature not checked: for its bearer to
    refuse early, in words, what the servers would refuse (a Spark driver writing with
    a read token). Grants nothing; raises SignatureRefused for text of no token."""
    envelope = token_envelope(token)
    payload = envelope[MAGIC_BYTES + KEY_ID_BYTES : -SIGNATURE_BYTES]
    try:
        if envelope[:MAGIC_BYTES] == TOKEN_MAGIC_UNLIMITED:
            return TokenClaims.decode_unlimited(payload)
        if envelope[:MAGIC_BYTES] == TOKEN_MAGIC:
            return TokenClaims.decode(payload)
    except MalformedPayload as error:
        raise SignatureRefused(f"malformed token claims: {error}") from None
    raise SignatureRefused("not a token of this cluster's format")


class Revocations:
    """Tokens revoked before they expire: token id -> its expiry, and a version that
    changes with every revocation (stores ask for the list when theirs differs)."""

    def __init__(self, revoked: Mapping[str, int] | None = None, version: int = 0) -> None:
        self._revoked = dict(revoked or {})
        self.version = version

    def __contains__(self, token_id: object) -> bool:
        return token_id in self._revoked

    def __len__(self) -> int:
        return len(self._revoked)

    def items(self) -> list[tuple[str, int]]:
        return sorted(self._revoked.items())

    def replace(self, revoked: Iterable[tuple[str, int]], version: int) -> None:
        self._revoked = dict(revoked)
        self.version = version

    def prune(self, now_ms: int) -> None:
        """Forget revocations of tokens expired by now (refused as expired anyway)."""
        self._revoked = {t: e for t, e in self._revoked.items() if e > now_ms}


def check_claims(claims: TokenClaims, now_ms: int, revocations: Revocations) -> Denial | None:
    if now_ms >= claims.expires_at_ms:
        return Denial(f"token {claims.token_id} expired")
    if claims.token_id in revocations:
        return Denial(f"token {claims.token_id} was revoked")
    return None


def resolve_caller(
    identity: Principal,
    bearer: str | None,
    verifier: Verifier,
    revocations: Revocations,
    now_ms: int,
) -> Principal | Denial:
    """The principal of a call: `identity` from its certificate proof (ANONYMOUS over TLS
    without one, INSECURE over plaintext), `bearer` the token it carries, if any. A
    Denial when its token is invalid, expired or revoked. Raises NoVerifyingKey when a
    token cannot be checked yet (a store that has not heard from the master)."""
    if identity.kind not in (PrincipalKind.UNAUTHENTICATED_INSECURE, PrincipalKind.ANONYMOUS):
        return identity
    if bearer is None:
        return identity
    try:
        claims = open_token(verifier, bearer)
    except NoVerifyingKey:
        raise  # nothing is known here yet: not a bad token
    except SignatureRefused as error:
        return Denial(f"the token is not valid here: {error}")
    denial = check_claims(claims, now_ms, revocations)
    return denial if denial is not None else claims.principal()
