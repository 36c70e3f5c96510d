"""`streamengine token create|revoke`: tenant tokens, for cluster admins.

`create` prints the token alone on stdout (so `export STREAMENGINE_TOKEN=$(streamengine
token create ...)` works) and what it is on stderr: its id (to revoke it), tenant, role
and expiry. The master keeps no copy of the token: lose it and create another.
"""

from __future__ import annotations

import argparse
import sys
import time

from streamengine.client.errors import InvalidArgument
from streamengine.tools.ops import RPC_TIMEOUT_S, client_transport, master_stub
from streamengine.v1 import master_pb2

ROLES = {
    "read": master_pb2.TOKEN_ROLE_READ,
    "write": master_pb2.TOKEN_ROLE_WRITE,
    "admin": master_pb2.TOKEN_ROLE_ADMIN,
}


def cmd_token_create(args: argparse.Namespace) -> int:
    with master_stub(args.master, client_transport(args)) as master:
        reply = master.CreateToken(
            master_pb2.CreateTokenRequest(
                tenant=args.tenant, role=ROLES[args.role], ttl_ms=args.ttl or 0
            ),
            timeout=RPC_TIMEOUT_S,
        )
    expires = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(reply.expires_at_ms / 1000))
    print(reply.token)
    print(
        f"token {reply.token_id}: tenant {args.tenant}, role {args.role}, expires {expires}",
        file=sys.stderr,
    )
    return 0


def cmd_token_revoke(args: argparse.Namespace) -> int:
    with master_stub(args.master, client_transport(args)) as master:
        reply = master.RevokeToken(
            master_pb2.RevokeTokenRequest(token_id=args.token_id), timeout=RPC_TIMEOUT_S
        )
    if not reply.revoked:
        raise InvalidArgument(f"no unexpired token {args.token_id} (expired, revoked, or unknown)")
    print(f"revoked token {args.token_id}; stores refuse it within a few seconds")
    return 0
