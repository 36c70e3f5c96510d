"""Authority in real-process tests: the master's key as the master keeps it, tokens,
and calls carrying a token.

`master_signing_key` reads the key a running master signs with now, from its metadata (a RocksDB
secondary instance beside the master's own): a test that must play a later leader, or
forge nothing but the master's own word, signs with it. Nothing else in a test has it.
"""

from __future__ import annotations

import tempfile

import grpc
from rocksdict import AccessType, Options, Rdict

from streamengine.master.catalog import decode_records
from streamengine.master.core import keys
from streamengine.master.rocksdb_metadata import CATALOG_DIR
from streamengine.protocol.auth import AUTHORIZATION_METADATA_KEY, BEARER_PREFIX
from streamengine.protocol.clock import wall_ms
from streamengine.protocol.grants import Grant, GrantSegment, GrantSigner
from streamengine.protocol.signing import SigningKey
from streamengine.protocol.transport import Transport
from streamengine.testing import Cluster
from streamengine.v1 import master_pb2, master_pb2_grpc


def master_signing_key(cluster: Cluster) -> SigningKey:
    catalog = cluster.root / "master" / CATALOG_DIR
    with tempfile.TemporaryDirectory() as secondary:
        options = Options(raw_mode=True)
        db = Rdict(str(catalog), options, access_type=AccessType.secondary(secondary))
        try:
            db.try_catch_up_with_primary()
            records = [(k, v) for k, v in db.items() if isinstance(k, bytes)]
            loaded = decode_records([(k, v) for k, v in records if isinstance(v, bytes)])
        finally:
            db.close()
    assert loaded.signing_keys, "the master keeps its keys from its first start"
    signing = keys.signing_key([record for record, _ in loaded.signing_keys.values()], wall_ms())
    return SigningKey(loaded.signing_keys[signing.key_id][1])


def signed_grant(
    cluster: Cluster,
    stream_id: int,
    epoch: int,
    segments: dict[int, list[str]],
    tenant: str,
    client_id: str = "a-later-leader",
) -> bytes:
    """A grant of `epoch` as the cluster's master would sign it (good for an hour)."""
    listed = tuple(GrantSegment(e, tuple(stores)) for e, stores in sorted(segments.items()))
    grant = Grant(stream_id, epoch, tenant, client_id, listed, wall_ms() + 3600_000)
    return GrantSigner(master_signing_key(cluster)).sign(grant)


def bearer(token: str) -> tuple[tuple[str, str], ...]:
    """Call metadata carrying `token`."""
    return ((AUTHORIZATION_METADATA_KEY, BEARER_PREFIX + token),)


def create_token(
    master_address: str, tenant: str, role: master_pb2.TokenRole.ValueType, ttl_ms: int = 0
) -> tuple[str, str]:
    """(token, token id), made by a caller the plaintext master allows everything."""
    with grpc.insecure_channel(master_address) as channel:
        reply = master_pb2_grpc.MasterStub(channel).CreateToken(
            master_pb2.CreateTokenRequest(tenant=tenant, role=role, ttl_ms=ttl_ms), timeout=10
        )
    return reply.token, reply.token_id



def create_token_as(
    transport: Transport,
    master_address: str,
    tenant: str,
    role: master_pb2.TokenRole.ValueType,
) -> str:
    """A token of `tenant`, made by a cluster admin over TLS (`transport`)."""
    with transport.channel(master_address) as channel:
        reply = master_pb2_grpc.MasterStub(channel).CreateToken(
            master_pb2.CreateTokenRequest(tenant=tenant, role=role), timeout=10
        )
    return str(reply.token)
