"""What the master's console answers a GET (`console.console_reply`), apart from its
HTTP thread: each caller sees what its credentials allow, a standby only who serves."""

from __future__ import annotations

import json
from typing import Any

from prometheus_client import CollectorRegistry, Gauge

from streamengine.master.console import ConsoleView, console_reply
from streamengine.protocol.auth import INSECURE, Role
from streamengine.protocol.signing import SigningKey, Verifier
from streamengine.protocol.tokens import Revocations, TokenClaims, mint_token
from streamengine.v1 import master_pb2

KEY = SigningKey(bytes(range(32)))
NOW_MS = 1_000_000


def _token(tenant: str, token_id: str = "0123456789abcdef") -> str:
    claims = TokenClaims(token_id, tenant, Role.READ, NOW_MS - 1, NOW_MS + 60_000)
    return mint_token(KEY, claims)


def _view(revoked: dict[str, int] | None = None) -> ConsoleView:
    status = master_pb2.ClusterStatus(
        cluster_id="c1",
        streams=[
            master_pb2.StreamInfo(name="acme/a", stream_id=1),
            master_pb2.StreamInfo(name="zeta/b", stream_id=2),
        ],
        tenant_streams=[
            master_pb2.TenantStreams(tenant="acme", streams=1),
            master_pb2.TenantStreams(tenant="zeta", streams=1),
        ],
    )
    segment = {"stream": "acme/a", "epoch": 1}
    return ConsoleView(
        status=status,
        segments={"acme/a": [segment], "zeta/b": [{**segment, "stream": "zeta/b"}]},
        verifier=Verifier([KEY.public_key]),
        revocations=Revocations(revoked),
    )


def _registry() -> CollectorRegistry:
    registry = CollectorRegistry()
    Gauge("streamengine_master_streams", "Streams", registry=registry).set(2)
    return registry


def _status(
    authorization: str | None, view: ConsoleView | None = None
) -> tuple[int, dict[str, Any]]:
    reply = console_reply(
        "/api/status", view or _view(), _registry(), INSECURE, authorization, NOW_MS
    )
    return reply.code, json.loads(reply.body)


def test_a_caller_without_a_token_on_a_plaintext_master_sees_every_tenant() -> None:
    code, status = _status(None)
    assert code == 200
    assert [s["name"] for s in status["streams"]] == ["acme/a", "zeta/b"]
    assert sorted(status["segments"]) == ["acme/a", "zeta/b"]


def test_a_tenants_token_sees_its_own_streams_segments_and_counts_only() -> None:
    code, status = _status(f"Bearer {_token('acme')}")
    assert code == 200
    assert [s["name"] for s in status["streams"]] == ["acme/a"]
    assert list(status["segments"]) == ["acme/a"]
    assert [t["tenant"] for t in status["tenant_streams"]] == ["acme"]


def test_a_token_that_does_not_hold_is_401_and_a_tenant_asking_for_metrics_403() -> None:
    assert _status("Bearer not-a-token")[0] == 401
    revoked = _view({"0123456789abcdef": NOW_MS + 60_000})
    assert _status(f"Bearer {_token('acme')}", revoked)[0] == 401
    reply = console_reply(
        "/metrics", _view(), _registry(), INSECURE, f"Bearer {_token('acme')}", NOW_MS
    )
    assert reply.code == 403


def test_metrics_unknown_paths_and_a_standby() -> None:
    metrics = console_reply("/metrics", _view(), _registry(), INSECURE, None, NOW_MS)
    assert metrics.code == 200 and b"streamengine_master_streams 2.0" in metrics.body
    assert console_reply("/nope", _view(), _registry(), INSECURE, None, NOW_MS).code == 404
    standby = {"starting": True, "standby": True, "active_master": "m2:7070"}
    reply = console_reply("/api/status", standby, _registry(), INSECURE, None, NOW_MS)
    assert reply.code == 200 and json.loads(reply.body) == standby
