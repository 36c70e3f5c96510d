"""etcd v3 as the master uses it: where it is, and calls that go to a member that answers.

`--metadata etcd://HOST:PORT[,HOST:PORT...][/PREFIX]` names the members and the prefix
under which this cluster keeps its keys (default `/streamengine`), so several clusters
can share one etcd:

    PREFIX/meta/<catalog key>          the master's records (`master.catalog`)
    PREFIX/master/<lease id, hex>      one key per master in the election, bound to its
                                       lease; the oldest is the active master, its value
                                       its address (`master.election`)
    PREFIX/writer                      rewritten by every commit (`etcd_metadata`)

The stubs are generated from etcd's own protos (`streamengine.etcd`, see
`proto/etcd_protos.py`). Calls go to one member at a time; a member that cannot be
reached (UNAVAILABLE) or does not answer in time is left for the next in the list, so
a three-member etcd losing one member costs one failed attempt, not an outage. etcd
forwards writes to its raft leader itself.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import grpc

from streamengine.etcd import rpc_pb2_grpc
from streamengine.master.core.errors import InvalidArgument
from streamengine.protocol import transport
from streamengine.protocol.channels import CLIENT_OPTIONS

T = TypeVar("T")

ETCD_SCHEME = "etcd://"
PREFIX_DEFAULT = "/streamengine"
META_DIR = b"/meta/"
ELECTION_DIR = b"/master"

# Codes after which another member may answer: it is down, unreachable, or has no
# raft leader (etcd answers those with UNAVAILABLE too).
_NEXT_MEMBER_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})

# Where `EtcdClient` gets its channels to a member when set: the deterministic simulator
# (tests/sim/runtime) serves an in-memory etcd on its network there. None, as shipped:
# grpc's own, with the client's TLS.
channel_factory: Callable[[str], grpc.Channel] | None = None
aio_channel_factory: Callable[[str], grpc.aio.Channel] | None = None


@dataclass(frozen=True, slots=True)
class EtcdConfig:
    endpoints: tuple[str, ...]
    prefix: bytes

    @property
    def meta_prefix(self) -> bytes:
        return self.prefix + META_DIR

    @property
    def election_name(self) -> bytes:
        return self.prefix + ELECTION_DIR

    def url(self) -> str:
        return f"{ETCD_SCHEME}{','.join(self.endpoints)}{self.prefix.decode()}"


def is_etcd_url(value: str) -> bool:
    return value.startswith(ETCD_SCHEME)


def parse_etcd_url(url: str) -> EtcdConfig:
    """`etcd://h1:2379,h2:2379/prefix` → members and key prefix; raises InvalidArgument."""
    if not is_etcd_url(url):
        raise InvalidArgument(f"{url!r} is not an etcd:// URL")
    rest = url[len(ETCD_SCHEME) :]
    hosts, slash, path = rest.partition("/")
    prefix = ("/" + path.strip("/")) if slash and path.strip("/") else PREFIX_DEFAULT
    endpoints = tuple(e.strip() for e in hosts.split(",") if e.strip())
    if not endpoints:
        raise InvalidArgument(f"{url!r} names no etcd member")
    for endpoint in endpoints:
        host, colon, port = endpoint.rpartition(":")
        if not colon or not host or not port.isdigit():
            raise InvalidArgument(f"etcd member {endpoint!r} must be HOST:PORT")
    if len(set(endpoints)) != len(endpoints):
        raise InvalidArgument(f"{url!r} names a member twice")
    return EtcdConfig(endpoints, prefix.encode())


@dataclass(frozen=True)
class EtcdTLS:
    """TLS to etcd with a client certificate (etcd's `--client-cert-auth`): the
    cluster's CA checks etcd's certificate, and etcd checks ours against it."""

    ca_pem: bytes
    cert_pem: bytes
    key_pem: bytes = field(repr=False)

    @classmethod
    def from_certs_dir(cls, certs_dir: Path) -> EtcdTLS:
        """A master's node certificate, or else the operator's `etcd-root.crt` (`metadata
        secure` makes it; `backup` and `restore` use it). Raises TransportError when
        neither is there."""
        cert, key = certs_dir / transport.NODE_CERT, certs_dir / transport.NODE_KEY
        if not cert.exists():
            cert, key = certs_dir / transport.ETCD_ROOT_CERT, certs_dir / transport.ETCD_ROOT_KEY
        try:
            return cls(
                (certs_dir / transport.CA_CERT).read_bytes(), cert.read_bytes(), key.read_bytes()
            )
        except OSError as error:
            raise transport.TransportError(
                f"etcd over TLS needs ca.crt and node.crt/key (or etcd-root.crt/key) in "
                f"{certs_dir}: {error.strerror or error}"
            ) from None

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(self.ca_pem, self.key_pem, self.cert_pem)


class EtcdClient:
    """Channels to every member, blocking and asyncio, and the member to try first.

    Blocking calls serve the metadata store (the master's state commits synchronously,
    see `master.etcd_metadata`); asyncio calls serve the election and its keepalive."""

    def __init__(self, config: EtcdConfig, tls: EtcdTLS | None = None) -> None:
        self.config = config
        self._tls = tls
        self._current = 0
        self._sync: dict[str, grpc.Channel] = {}
        self._aio: dict[str, grpc.aio.Channel] = {}

    @property
    def member(self) -> str:
        return self.config.endpoints[self._current]

    def member_failed(self, member: str) -> None:
        """Try the next member from now on (unless another call moved on already)."""
        if self.member == member:
            self._current = (self._current + 1) % len(self.config.endpoints)

    def _sync_channel(self, member: str) -> grpc.Channel:
        channel = self._sync.get(member)
        if channel is None:
            if channel_factory is not None:
                channel = channel_factory(member)
            elif self._tls is None:
                channel = grpc.insecure_channel(member, options=CLIENT_OPTIONS)
            else:
                channel = grpc.secure_channel(member, self._tls.credentials(), CLIENT_OPTIONS)
            self._sync[member] = channel
        return channel

    def aio_channel(self, member: str) -> grpc.aio.Channel:
        channel = self._aio.get(member)
        if channel is None:
            if aio_channel_factory is not None:
                channel = aio_channel_factory(member)
            elif self._tls is None:
                channel = grpc.aio.insecure_channel(member, options=CLIENT_OPTIONS)
            else:
                channel = grpc.aio.secure_channel(member, self._tls.credentials(), CLIENT_OPTIONS)
            self._aio[member] = channel
        return channel

    def kv(self, member: str) -> rpc_pb2_grpc.KVStub:
        return rpc_pb2_grpc.KVStub(self._sync_channel(member))

    def lease(self, member: str) -> rpc_pb2_grpc.LeaseStub:
        return rpc_pb2_grpc.LeaseStub(self._sync_channel(member))

    def aio_kv(self, member: str) -> rpc_pb2_grpc.KVAsyncStub:
        return rpc_pb2_grpc.KVStub(self.aio_channel(member))

    def aio_lease(self, member: str) -> rpc_pb2_grpc.LeaseAsyncStub:
        return rpc_pb2_grpc.LeaseStub(self.aio_channel(member))

    def call(
        self,
        attempt: Callable[[str, float], T],
        timeout_s: float,
        attempt_timeout_s: float | None = None,
    ) -> T:
        """`attempt(member, timeout_s)` on one member after another (each at most once)
        until one answers or `timeout_s` is spent, each attempt given at most
        `attempt_timeout_s` (a member cut off the network must not take all the time);
        the last error is raised as it is. Only for calls whose repetition is harmless:
        reads, and transactions whose comparisons make a second application fail
        (`etcd_metadata`)."""
        deadline = time.monotonic() + timeout_s
        per_attempt = timeout_s if attempt_timeout_s is None else attempt_timeout_s
        for _ in self.config.endpoints:
            member = self.member
            try:
                left = max(0.0, deadline - time.monotonic())
                return attempt(member, min(left, per_attempt))
            except grpc.RpcError as error:
                if error.code() not in _NEXT_MEMBER_CODES:
                    raise
                self.member_failed(member)
                if time.monotonic() >= deadline:
                    raise
                last: grpc.RpcError = error
        raise last

    def close(self) -> None:
        for channel in self._sync.values():
            channel.close()
        self._sync.clear()

    async def aclose(self) -> None:
        self.close()
        channels, self._aio = list(self._aio.values()), {}
        for channel in channels:
            await channel.close()
