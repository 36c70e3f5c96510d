"""Who a gRPC call comes from, for the master's and the stores' servicers alike.

`Callers.principal(context)` turns a call into a `Principal` (or a `Denial`): the
identity its certificate proves (`identity.caller_identity`: a member or an admin over
TLS, ANONYMOUS over TLS without a proof, INSECURE over plaintext), with the token of its
`authorization: Bearer` metadata, by `tokens.resolve_caller`. The servicer then asks
`auth.authorize(principal, rpc, tenant)` and answers a denial with PERMISSION_DENIED,
changing nothing; a certificate proof that does not hold (`identity.ProofRefused`,
raised) and a token that is not valid (forged, expired, revoked: the `Denial` this
returns) are UNAUTHENTICATED: the caller is nobody proven, not somebody refused.

Which calls must prove who they are is the transport's one decision: a TLS server never
sees an INSECURE caller (a caller without a certificate proof is ANONYMOUS until a token
says more), a plaintext one (loopback, or --insecure) sees every caller without a token
as INSECURE, allowed everything as before security existed; a caller that shows a token
is held to it either way.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc

from streamengine.protocol.auth import (
    AUTHORIZATION_METADATA_KEY,
    BEARER_PREFIX,
    Denial,
    Principal,
)
from streamengine.protocol.clock import wall_ms
from streamengine.protocol.identity import caller_identity
from streamengine.protocol.signing import Verifier
from streamengine.protocol.tokens import Revocations, resolve_caller

Context = grpc.aio.ServicerContext[Any, Any]


def bearer_token(context: Context) -> str | None:
    """The token of the call's `authorization: Bearer <token>` metadata, if any (a
    value without the Bearer prefix is a token too: nothing else goes there)."""
    for key, value in context.invocation_metadata() or ():
        if key == AUTHORIZATION_METADATA_KEY:
            text = value.decode("utf-8", "replace") if isinstance(value, bytes) else value
            return token_of_authorization(text)
    return None


def token_of_authorization(value: str) -> str:
    """The token of an `authorization` value (gRPC metadata or an HTTP header)."""
    return value.removeprefix(BEARER_PREFIX).strip()


@dataclass
class Callers:
    """Resolves the principal of each call: see the module doc."""

    verifier: Verifier
    revocations: Callable[[], Revocations]
    clock_ms: Callable[[], int] = wall_ms

    def principal(self, context: Context) -> Principal | Denial:
        """Raises identity.ProofRefused for a certificate proof that does not hold, and
        NoVerifyingKey when the call's token cannot be checked yet."""
        return self.principal_of(caller_identity(context), bearer_token(context))

    def principal_of(self, identity: Principal, bearer: str | None) -> Principal | Denial:
        """The same for a caller known otherwise: the data plane's, by the certificate
        of its TLS handshake and the token of its hello (`framed.py`)."""
        return resolve_caller(identity, bearer, self.verifier, self.revocations(), self.clock_ms())
