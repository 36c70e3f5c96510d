"""`streamengine token create|revoke` and `streamengine key rotate|list`: tenant
tokens and the master's signing keys, for cluster admins.

`create` prints the token alone on stdout (so `export STREAMENGINE_TOKEN=$(streamengine
token create ...)` works) and what it is on stderr: its id (to revoke it), tenant, role
and expiry. The master keeps no copy of the token: lose it and create another. With
`--stream NAME` (repeated) a read token is limited to those streams (by their ids now:
a stream deleted and made again under the name is not one of them).

`key rotate` adds a key that signs from then on and lists the keys as `key list` does:
one line each, newest first: its id, when it was made, and whether it signs, when it
will (a new key signs once every store can have heard of it) or when it is retired
(once all it signed has expired).
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
        stream_ids = [
            master.DescribeStream(
                master_pb2.DescribeStreamRequest(name=name), timeout=RPC_TIMEOUT_S
            ).stream_id
            for name in args.stream
        ]
        reply = master.CreateToken(
            master_pb2.CreateTokenRequest(
                tenant=args.tenant,
                role=ROLES[args.role],
                ttl_ms=args.ttl or 0,
                stream_ids=stream_ids,
            ),
            timeout=RPC_TIMEOUT_S,
        )
    expires = _utc(reply.expires_at_ms)
    print(reply.token)
    print(
        f"token {reply.token_id}: tenant {args.tenant}, role {args.role}, expires {expires}"
        + (f", streams {', '.join(args.stream)}" if args.stream else ""),
        file=sys.stderr,
    )
    return 0


def cmd_key_rotate(args: argparse.Namespace) -> int:
    with master_stub(args.master, client_transport(args)) as master:
        reply = master.RotateSigningKey(
            master_pb2.RotateSigningKeyRequest(), timeout=RPC_TIMEOUT_S
        )
    _print_keys(reply)
    return 0


def cmd_key_list(args: argparse.Namespace) -> int:
    with master_stub(args.master, client_transport(args)) as master:
        reply = master.ListSigningKeys(master_pb2.ListSigningKeysRequest(), timeout=RPC_TIMEOUT_S)
    _print_keys(reply)
    return 0


def _print_keys(reply: master_pb2.SigningKeys) -> None:
    print(f"{'KEY':<16}  {'CREATED':<23}  STATE")
    for key in reply.keys:
        states = []
        if key.signing:
            states.append("signing")
        elif not key.retiring_at_ms:
            states.append(f"signs from {_utc(key.signs_from_ms)}")
        if key.retiring_at_ms:
            states.append(f"retiring at {_utc(key.retiring_at_ms)}")
        state = ", ".join(states)
        created = _utc(key.created_at_ms) if key.created_at_ms else "before rotation"
        print(f"{key.key_id:<16}  {created:<23}  {state}")


def _utc(ms: int) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(ms / 1000))


def cmd_token_revoke(args: argparse.Namespace) -> int:
    with master_stub(args.master, client_transport(args)) as master:
        reply = master.RevokeToken(
            master_pb2.RevokeTokenRequest(token_id=args.token_id), timeout=RPC_TIMEOUT_S
        )
    if not reply.revoked:
        raise InvalidArgument(f"no unexpired token {args.token_id} (expired, revoked, or unknown)")
    print(f"revoked token {args.token_id}; stores refuse it within a few seconds")
    return 0
