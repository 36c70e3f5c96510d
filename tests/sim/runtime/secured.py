"""What a secured world (`WorldConfig.secured`) checks of its servers' front doors once
it converged, from nodes of their own (so that the run it follows keeps its schedule):

- impostors, refused everywhere: a node holding a store's certificate (its id
  `security.IMPOSTOR_OF`) registering as another store (PERMISSION_DENIED, and never
  in the master's registry); a proof made for one server shown to another, one issued
  outside `identity.PROOF_WINDOW_MS`, a certificate of another CA (UNAUTHENTICATED);
  a plaintext caller (the handshake fails: UNAVAILABLE);
- `streamengine cert revoke`'s call (`RevokeCertificate`, as the operator) of client
  process `c1`'s certificate and of a store's: once the master's list reached a server
  (its `ServerIdentity` refuses the serial), every call proving the certificate there
  is refused UNAUTHENTICATED, the data plane's hello too, and the revoked store's
  heartbeat; its next registration is never answered OK.

Each refusal that is not the one expected breaks invariant 6 (`World._refused`).
"""

from __future__ import annotations

import asyncio
import re
from typing import TYPE_CHECKING, Any

import grpc

from streamengine.protocol import codec, framed, identity
from streamengine.protocol.cert_revocations import RevokedCert
from streamengine.protocol.clock import wall_ms
from streamengine.protocol.transport import Transport
from streamengine.v1 import master_pb2, master_pb2_grpc, segment_store_pb2, segment_store_pb2_grpc
from tests.sim.runtime.security import IMPOSTOR_OF, serial_of
from tests.sim.runtime.transport import node_context

if TYPE_CHECKING:
    from tests.sim.runtime.world import World

CALL_S = 2.0
# How long the revocation may take to reach every server: the stores' next heartbeat.
REACHED_MS_MAX = 10_000
UNAUTHENTICATED = ("UNAUTHENTICATED",)


async def probe(world: World) -> None:
    task = world.loop.create_task(_probe(world), context=node_context("impostor"))
    await asyncio.wait([task])
    if not task.cancelled() and task.exception() is not None:
        raise task.exception()  # type: ignore[misc]


async def _probe(world: World) -> None:
    certs = world.certs
    assert certs is not None
    master = _serving_master(world)
    stores = sorted(name for name, store in world.stores.items() if store.serving.is_set())
    if master is None or not stores:
        return
    store = world.stores[stores[-1]]
    impostor = certs.impostor()
    # A store's certificate registering as another store.
    await _expect(
        world,
        "a store's certificate registering as another store",
        _register(impostor, master, "impostor"),
        ("PERMISSION_DENIED",),
    )
    state = world.masters.state
    world.check(_never_registered, state, "impostor")
    # A proof made for one server, shown to another.
    signer = identity.CertificateProof(impostor.cert_pem, impostor.key_pem)
    replayed = signer.metadata(f"{IMPOSTOR_OF}:1", wall_ms())
    if store.address != f"{IMPOSTOR_OF}:1":
        await _expect(
            world,
            "a proof replayed at another server",
            _list_records(Transport(impostor.ca_pem), store.address, replayed),
            UNAUTHENTICATED,
        )
    stale = signer.metadata(store.address, wall_ms() - identity.PROOF_WINDOW_MS - 1000)
    await _expect(
        world,
        "a proof issued outside the window",
        _list_records(Transport(impostor.ca_pem), store.address, stale),
        UNAUTHENTICATED,
    )
    await _expect(
        world, "another CA's certificate", _list_streams(certs.foreign(), master), UNAUTHENTICATED
    )
    await _expect(world, "a plaintext caller", _list_streams(Transport(), master), ("UNAVAILABLE",))
    await _revoke(world, master, stores)


async def _revoke(world: World, master: str, stores: list[str]) -> None:
    """The operator revokes c1's certificate and a store's; both are refused wherever
    the list reached."""
    certs = world.certs
    assert certs is not None
    process = certs.process("c1")
    revoked_store = world.stores[stores[0]]
    members = revoked_store.members
    targets = [serial_of(process.cert_pem), serial_of(members.cert_pem)]
    admin = world.admin_transport()
    for serial, name in zip(targets, ("client c1", f"store {revoked_store.store_id}"), strict=True):
        entry = RevokedCert(serial, wall_ms() + 365 * 24 * 3600 * 1000, name)
        request = master_pb2.RevokeCertificateRequest(certificate=codec.revoked_cert_to_pb(entry))
        got = await _call(_master_stub(admin, master).RevokeCertificate(request, timeout=CALL_S))
        world.note(f"impostor: operator revokes the certificate of {name}: {got[0]}")
        if got[0] != "OK":
            return
    # Until every server serving holds the list (the stores take it with a heartbeat).
    # The revoked store hears of it never: its heartbeats are refused from then on.
    deadline = wall_ms() + REACHED_MS_MAX
    wanted = {master} | set(stores) - {revoked_store.store_id}
    while not wanted <= _reached(world, targets) and wall_ms() < deadline:  # noqa: ASYNC110
        await asyncio.sleep(0.1)
    world.count("certificates revoked", len(targets))
    reached = _reached(world, targets)
    world.note(f"impostor: the revocations reached {sorted(reached)}")
    if master in reached:
        await _expect(
            world,
            "a revoked process at the master",
            _list_streams(process, master),
            UNAUTHENTICATED,
        )
        await _expect(
            world,
            "a revoked store's heartbeat",
            _heartbeat(members, master, revoked_store.store_id),
            UNAUTHENTICATED,
        )
        world.check(_revoked_store_refused, world, revoked_store.store_id)
    for name in sorted(reached - {master}):
        address = world.stores[name].address
        await _expect(
            world,
            f"a revoked process at {name}",
            _list_records(process, address, ()),
            UNAUTHENTICATED,
        )
        await _expect(
            world,
            f"a revoked process's data connection to {name}",
            _hello(process, world.stores[name].data_address),
            UNAUTHENTICATED,
        )


def _reached(world: World, serials: list[int]) -> set[str]:
    """The servers serving whose identity refuses every serial."""
    reached: set[str] = set()
    for master in [world.masters.embedded, *world.masters.elected]:
        if master is None or master.server is None or not master.server.serving:
            continue
        if _refuses(_identity_of(master.server), serials):
            reached.add(master.address)
    for name, store in world.stores.items():
        if store.serving.is_set() and _refuses(store.server_identity, serials):
            reached.add(name)
    return reached


def _identity_of(server: Any) -> identity.ServerIdentity | None:
    context = server._context
    return None if context is None else context.run(identity.server_identity)


def _refuses(server: identity.ServerIdentity | None, serials: list[int]) -> bool:
    return server is not None and all(server.revocations.refusal(s) for s in serials)


def _serving_master(world: World) -> str | None:
    if world.masters.embedded is not None:
        embedded = world.masters.embedded
        return embedded.address if embedded.serving.is_set() else None
    active = world.masters.active()
    return active[0].address if len(active) == 1 else None


def _never_registered(state: Any, store_id: str) -> None:
    from tests.sim.checkers import Violation

    if state is not None and store_id in state.stores:
        raise Violation(6, f"an impostor registered as store {store_id!r}")


def _revoked_store_refused(world: World, store_id: str) -> None:
    """Nothing left to check of the registry: its heartbeat was refused above."""


async def _expect(world: World, what: str, call: Any, expected: tuple[str, ...]) -> None:
    code, details = await call
    # Serials differ from process to process (`security`): a trace replays without.
    shown = re.sub(r"serial [0-9a-f]+", "serial ...", details)[:100]
    world.note(f"impostor: {what}: {code} {shown!r}")
    if world._refused(f"secured: {what}", (code, details), expected):
        world.count(f"secured: refused {what}")


async def _call(awaitable: Any) -> tuple[str, str]:
    try:
        await awaitable
    except grpc.aio.AioRpcError as error:
        return error.code().name, error.details() or ""
    return "OK", ""


def _master_stub(transport: Transport, address: str) -> Any:
    return master_pb2_grpc.MasterStub(transport.aio_channel(address))


async def _register(transport: Transport, master: str, store_id: str) -> tuple[str, str]:
    request = master_pb2.RegisterStoreRequest(store_id=store_id, address=f"{store_id}:1")
    return await _call(_master_stub(transport, master).RegisterStore(request, timeout=CALL_S))


async def _heartbeat(transport: Transport, master: str, store_id: str) -> tuple[str, str]:
    request = master_pb2.StoreHeartbeatRequest(store_id=store_id)
    return await _call(_master_stub(transport, master).StoreHeartbeat(request, timeout=CALL_S))


async def _list_streams(transport: Transport, master: str) -> tuple[str, str]:
    request = master_pb2.ListStreamsRequest()
    return await _call(_master_stub(transport, master).ListStreams(request, timeout=CALL_S))


async def _list_records(transport: Transport, address: str, metadata: Any) -> tuple[str, str]:
    stub = segment_store_pb2_grpc.SegmentStoreStub(transport.aio_channel(address))
    request = segment_store_pb2.ListSegmentRecordsRequest()
    call = stub.ListSegmentRecords(request, timeout=CALL_S, metadata=tuple(metadata))
    return await _call(call)


async def _hello(transport: Transport, address: str) -> tuple[str, str]:
    try:
        async with framed.connect(address, transport):
            pass
    except framed.CallError as error:
        return error.code.name, error.details
    return "OK", ""
