"""Who a gRPC call comes from, for the master's and the stores' servicers alike.

`Callers.principal(context)` turns a call into a `Principal` (or a `Denial`): the
identity its TLS certificate proves (`auth.identity_from_auth_context`; INSECURE for a
plaintext call), with the token of its `authorization: Bearer` metadata, by
`tokens.resolve_caller`. The servicer then asks `auth.authorize(principal, rpc, tenant)`
and answers a denial with PERMISSION_DENIED, changing nothing.

`require_auth` is the one switch of the authentication mode: True on a server that
requires every caller to prove who it is (a TLS server: members and admins by their
certificates, tenants by tokens), False on a plaintext one (loopback, or --insecure),
where a caller without a token may do anything, as before security existed, and a
caller with one is held to it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc

from streamengine.protocol.auth import (
    AUTHORIZATION_METADATA_KEY,
    BEARER_PREFIX,
    Denial,
    Principal,
    identity_from_auth_context,
)
from streamengine.protocol.signing import Verifier
from streamengine.protocol.tokens import Revocations, resolve_caller

Context = grpc.aio.ServicerContext[Any, Any]


def wall_clock_ms() -> int:
    """Tokens expire in wall-clock time: they outlive every process."""
    return time.time_ns() // 1_000_000


def bearer_token(context: Context) -> str | None:
    """The token of the call's `authorization: Bearer <token>` metadata, if any (a
    value without the Bearer prefix is a token too: nothing else goes there)."""
    for key, value in context.invocation_metadata() or ():
        if key == AUTHORIZATION_METADATA_KEY:
            text = value.decode("utf-8", "replace") if isinstance(value, bytes) else value
            return text.removeprefix(BEARER_PREFIX).strip()
    return None


def certificate_identity(context: Context) -> Principal:
    """What the call's TLS certificate proves (INSECURE for a plaintext call)."""
    return identity_from_auth_context(
        {key: list(values) for key, values in context.auth_context().items()}
    )


@dataclass
class Callers:
    """Resolves the principal of each call: see the module doc."""

    verifier: Verifier
    revocations: Callable[[], Revocations]
    require_auth: bool = False
    clock_ms: Callable[[], int] = wall_clock_ms

    def principal(self, context: Context) -> Principal | Denial:
        """Raises NoVerifyingKey when the call's token cannot be checked yet."""
        return resolve_caller(
            certificate_identity(context),
            bearer_token(context),
            self.verifier,
            self.revocations(),
            self.clock_ms(),
            self.require_auth,
        )
