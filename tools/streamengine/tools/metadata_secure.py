"""`streamengine metadata secure`: only the masters read and write their keys in etcd.

etcd with `--client-cert-auth` checks that a client's certificate is signed by the
cluster's CA, and until its own auth is enabled, every such certificate (a store's, a
client's that grants nothing) may read and write every key, the master's signing key
among them. This turns etcd's auth on, idempotently, so that each run leaves the same
state whatever the previous one did or did not finish:

- the user `root` with the role `root` (etcd wants it before `auth enable`), reached
  with `etcd-root.crt` (common name `root`), made in the certs dir from the CA if it is
  not there yet: the operator's key to etcd, written 0600;
- the role `streamengine-masters:PREFIX`, readwrite on the keys under `PREFIX/` only;
- a user per master identity, the common name of its certificate (`master` for every
  certificate of `cert create-node --master`), with that role;
- auth enabled.

etcd takes the certificate's common name as the user and asks no password, so any other
certificate of the CA (common names `store <id>`, `client <name>`, `etcd`) is a user
etcd does not know and gets nothing. That holds only where etcd asks every client for
a certificate: on a member that answers without one, nothing is changed and the
command says so (`NoClientCertAuth`), as auth there would lock the masters out.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

import grpc

from streamengine.client.errors import InvalidArgument, Unavailable
from streamengine.etcd import auth_pb2, rpc_pb2, rpc_pb2_grpc
from streamengine.master.core.errors import MasterError
from streamengine.master.etcd import EtcdConfig, EtcdTLS, parse_etcd_url
from streamengine.master.metadata import prefix_end
from streamengine.protocol.transport import ETCD_ROOT_CERT, TransportError
from streamengine.tools.certs import (
    ETCD_ROOT_USER,
    MASTER_COMMON_NAME,
    CertError,
    create_etcd_root,
)

ROOT_ROLE = "root"
CALL_TIMEOUT_S = 5.0
# What etcd answers (FAILED_PRECONDITION) to adding what is there already.
_ALREADY_THERE = ("already exists",)


def masters_role(config: EtcdConfig) -> str:
    return f"streamengine-masters:{config.prefix.decode()}"


def _tolerating_existing(call: grpc.UnaryUnaryMultiCallable[Any, Any], request: object) -> None:
    try:
        call(request, timeout=CALL_TIMEOUT_S)
    except grpc.RpcError as error:
        if not any(words in (error.details() or "") for words in _ALREADY_THERE):
            raise


class NoClientCertAuth(Exception):
    """etcd does not ask its clients for a certificate: with its auth on, it would take
    none of the masters' certificates as a user, and lock them out."""


def _asks_for_certificates(member: str, ca_pem: bytes) -> bool:
    """Whether `member` refuses a TLS client without a certificate (or cannot be reached:
    the calls that follow say so)."""
    with grpc.secure_channel(member, grpc.ssl_channel_credentials(ca_pem)) as channel:
        try:
            rpc_pb2_grpc.MaintenanceStub(channel).Status(
                rpc_pb2.StatusRequest(), timeout=CALL_TIMEOUT_S
            )
        except grpc.RpcError as error:
            return bool(error.code() == grpc.StatusCode.UNAVAILABLE)
    return False


def secure_etcd(config: EtcdConfig, root: EtcdTLS, master_users: Sequence[str]) -> None:
    """Make `config`'s etcd as the module doc says, reached as `root`. Raises
    NoClientCertAuth (before changing anything) when a member answers a client without
    a certificate, grpc.RpcError when etcd refuses or cannot be reached."""
    assert master_users, "at least one master identity"
    no_password = auth_pb2.UserAddOptions(no_password=True)
    role = masters_role(config)
    last: grpc.RpcError | None = None
    for member in config.endpoints:
        if not _asks_for_certificates(member, root.ca_pem):
            raise NoClientCertAuth(
                f"etcd member {member} answers clients without a certificate: start it with "
                "--client-cert-auth (ETCD_CLIENT_CERT_AUTH=true) first, or its auth would "
                "lock the masters out"
            )
    for member in config.endpoints:
        # etcd forwards auth changes to its raft leader: any member that answers will do.
        with grpc.secure_channel(member, root.credentials()) as channel:
            stub = rpc_pb2_grpc.AuthStub(channel)
            try:
                root_user = rpc_pb2.AuthUserAddRequest(name=ETCD_ROOT_USER, options=no_password)
                _tolerating_existing(stub.UserAdd, root_user)
                stub.UserGrantRole(
                    rpc_pb2.AuthUserGrantRoleRequest(user=ETCD_ROOT_USER, role=ROOT_ROLE),
                    timeout=CALL_TIMEOUT_S,
                )
                _tolerating_existing(stub.RoleAdd, rpc_pb2.AuthRoleAddRequest(name=role))
                # `PREFIX/`, not `PREFIX`: a cluster under /a must not reach /ab's keys.
                keys = config.prefix + b"/"
                permission = auth_pb2.Permission(
                    permType=auth_pb2.Permission.READWRITE, key=keys, range_end=prefix_end(keys)
                )
                stub.RoleGrantPermission(
                    rpc_pb2.AuthRoleGrantPermissionRequest(name=role, perm=permission),
                    timeout=CALL_TIMEOUT_S,
                )
                for user in master_users:
                    _tolerating_existing(
                        stub.UserAdd, rpc_pb2.AuthUserAddRequest(name=user, options=no_password)
                    )
                    stub.UserGrantRole(
                        rpc_pb2.AuthUserGrantRoleRequest(user=user, role=role),
                        timeout=CALL_TIMEOUT_S,
                    )
                stub.AuthEnable(rpc_pb2.AuthEnableRequest(), timeout=CALL_TIMEOUT_S)
                return
            except grpc.RpcError as error:
                if error.code() not in (
                    grpc.StatusCode.UNAVAILABLE,
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                ):
                    raise
                last = error
    assert last is not None
    raise last


def cmd_secure(args: argparse.Namespace) -> int:
    try:
        config = parse_etcd_url(args.metadata)
    except MasterError as error:
        raise InvalidArgument(f"--metadata: {error}") from None
    try:
        create_etcd_root(args.certs_dir, args.ca_key)
        root = EtcdTLS.from_certs_dir(args.certs_dir)
    except (CertError, TransportError) as error:
        raise InvalidArgument(str(error)) from None
    users = args.master_name or [MASTER_COMMON_NAME]
    try:
        secure_etcd(config, root, users)
    except NoClientCertAuth as error:
        raise InvalidArgument(str(error)) from None
    except grpc.RpcError as error:
        hint = (
            " (is every member up, serving TLS with a certificate of this CA?)"
            if error.code() == grpc.StatusCode.UNAVAILABLE
            else ""
        )
        raise Unavailable(
            f"etcd refused or did not answer: {error.code().name}: {error.details()}{hint}"
        ) from None
    print(
        f"etcd auth enabled: root with {args.certs_dir / ETCD_ROOT_CERT}; "
        f"{', '.join(users)} read and write {config.prefix.decode()}/ only"
    )
    return 0
