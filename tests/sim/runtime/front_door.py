"""The front door once the world converged: every kind of request the servers must
refuse, and the calls an operator makes beside them, against the cluster the run left.

In a share of seeds but the crowds (`WorldConfig.front_door`, drawn from
`random.Random(f"{seed}/front-door")`, its calls from
`random.Random(f"{seed}/front-door/calls")`), once the world converged and its checkers
judged the run, a caller of its own (node `front-door`) knocks at the shipped servers as
the fault suite's S15 does on real processes (`tests.faults.badinput`):

- every row of `badinput.ROWS` a plaintext cluster answers (unknown streams and
  tenants, names without a tenant, W > N, stale epochs and missing grants at the master
  and at the stores, an event one byte over the limit, batches over their bounds, reads
  of segments not held, a Subscribe without a start), aimed at a sealed and an open
  segment of the world's streams, each answered with its status exactly;
- rows of its own: `streamengine verify`'s certified digests, a reader's report of a
  sound replica and of an unknown stream, reads and digests of ranges no replica holds;
- multiplexed Subscribe calls with bad tails (each ended with its status, the call
  going on);
- random bytes to every RPC of the master and the stores and to the stores' data plane
  (INVALID_ARGUMENT, exactly), and well-formed requests of the fuzz namespace with a few
  bytes changed (`badinput.mutate`) to those that cannot disturb the cluster
  legitimately: never UNKNOWN or INTERNAL;

each a violation of invariant 6 otherwise. Before and after, the master's streams
(ids, policies) and what every replica holds (`_unchanged`): what a refusal changed,
they show (invariant 6 too); the world's audits run all along. Then the operator:
`token create` mistyped (refused, exactly), a read token limited to one stream held to
it until it expires, revoked; a stream of its own led while a store's disk is full and
after it is freed, the master's key rotated meanwhile: appends are acked again once the
disk is free, and every acked event is read back once, in order, then the stream
sealed, trimmed (a follower from 0 told `Trimmed`) and deleted; `metadata backup` of a
running embedded master on RocksDB, which holds every record the master does; and a
store of another cluster pointed at this master, refused for good.

The schedule of the run before it is the seed's as it was: it starts once the verdict
is in, and a seed without it ends there.

Why one long module: the front door is one caller's script, its requests, the calls
that carry them and the judgement of their answers; split, each part would only be
read with the others.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import grpc
from google.protobuf.message import Message

from streamengine import StreamClient
from streamengine.client.errors import EventTooLarge, StreamEngineError, Trimmed
from streamengine.client.writer import Writer
from streamengine.master.rocksdb_metadata import RocksDBMetadata, snapshot_records
from streamengine.protocol import framed, framing
from streamengine.protocol.entry import CorruptEntry
from streamengine.protocol.limits import CREATE_STREAMS_PER_CALL_MAX, EPOCH_MAX, EVENT_BYTES_MAX
from streamengine.protocol.tokens import TOKEN_STREAMS_MAX, TOKEN_TTL_MS_MIN
from streamengine.protocol.transport import Transport
from streamengine.segment_store.core.commands import SegmentKey
from streamengine.segment_store.core.keys import CLUSTER_ID_KEY
from streamengine.segment_store.core.kv import Put
from streamengine.segment_store.master_link import WrongCluster
from streamengine.v1 import entry_pb2, master_pb2
from streamengine.v1 import segment_store_pb2 as s
from streamengine.v1 import segment_store_pb2_grpc as store_grpc
from tests.faults import badinput
from tests.sim.checkers import Violation
from tests.sim.runtime.store import SimStore
from tests.sim.runtime.transport import node_context

if TYPE_CHECKING:
    from tests.sim.runtime.world import World

# The share of seeds whose front door is knocked at once the world converged.
FRONT_DOOR_SHARE = 0.6
# Random and mutated requests sent after the rows.
FUZZ_CALLS = 60
CALL_S = 2.0
# The front door's own stream: how long an append may take, how many go while a store's
# disk is full and how long it stays full, how many after (until a few are acked), and
# how long reading every acked event back may take.
OWN_APPEND_S = 3.0
FULL_APPENDS = 6
FULL_S = 2.0
AFTER_APPENDS = 8
AFTER_ACKED = 2
READ_BACK_S = 30.0
# How long a multiplexed Subscribe's replies are read before its side closes.
TAIL_WAIT_S = 0.5
# What a call cut short by a server's restart may end with (none is, once converged).
NOT_THROUGH = ("UNAVAILABLE", "DEADLINE_EXCEEDED", "CANCELLED")
# A store of another cluster pointed at this master, and how soon its process must end.
STRANGER = "stranger"
STRANGER_S = 10.0
# Statuses a server never gives on purpose.
UNCLEAR = ("UNKNOWN", "INTERNAL")


@dataclass(frozen=True, slots=True)
class Replica:
    """What a store holds of one segment, as the front door compares it: its fence, and
    the digest of its indexes up to `up_to` (its last, sealed and complete to the
    bridge the master recorded; else its acked: a recovery may replace what lies above,
    and the repairer refill a sealed replica that missed the bridge, fencing it anew).
    """

    fence: int
    up_to: int
    digest: bytes
    complete: bool


class FrontDoor:
    """The front door's caller for one converged world (module doc)."""

    def __init__(self, world: World) -> None:
        self.world = world
        self.rng = random.Random(f"{world.config.seed}/front-door/calls")
        self.transport = Transport()

    async def run(self) -> None:
        async with StreamClient(self.world.masters.address) as client:
            live = await self._live(client)
            if live is None:
                self.world.count("front door: no sealed segment to aim at")
            else:
                before = self._look()
                await self._rows(live)
                await self._own_rows(live)
                await self._as_another_tenant(live)
                await self._tails(live)
                await self._fuzz()
                after = self._look()
                self._unchanged(before, after)
            await self._tokens(client)
            await self._own_stream(client)
        await self._stranger()
        self._backup()

    # ---- the operator ----

    async def _tokens(self, client: StreamClient) -> None:
        """`streamengine token create` as an operator may mistype it (refused, exactly),
        a read token limited to one stream (`--stream`), held to it, and short-lived
        tokens that expire and are revoked (`token revoke`)."""
        streams = sorted(s for s in self.world.stream_names if s not in self.world.removed)
        state = self.world.masters.state
        if state is None or not streams:
            return
        ids = {name: state.streams[name].stream_id for name in streams if name in state.streams}
        if not ids:
            return
        mine = self.rng.choice(sorted(ids))
        tenant = mine.split("/")[0]
        other_tenant = [name for name in sorted(ids) if not name.startswith(f"{tenant}/")]
        same_tenant = [n for n in sorted(ids) if n.startswith(f"{tenant}/") and n != mine]
        read, write = master_pb2.TOKEN_ROLE_READ, master_pb2.TOKEN_ROLE_WRITE
        refused: list[tuple[str, master_pb2.CreateTokenRequest]] = [
            ("an unknown role", master_pb2.CreateTokenRequest(tenant=tenant, role=cast(Any, 99))),
            (
                "a lifetime below the least",
                master_pb2.CreateTokenRequest(
                    tenant=tenant, role=read, ttl_ms=TOKEN_TTL_MS_MIN - 1
                ),
            ),
            (
                "a write token limited to a stream",
                master_pb2.CreateTokenRequest(tenant=tenant, role=write, stream_ids=[ids[mine]]),
            ),
            (
                "a token limited to too many streams",
                master_pb2.CreateTokenRequest(
                    tenant=tenant,
                    role=read,
                    stream_ids=[ids[mine] + n for n in range(TOKEN_STREAMS_MAX + 1)],
                ),
            ),
        ]
        if other_tenant:
            request = master_pb2.CreateTokenRequest(
                tenant=tenant, role=read, stream_ids=[ids[other_tenant[0]]]
            )
            refused.append(("a token limited to another tenant's stream", request))
        for what, request in refused:
            code, details = await self._master_call("CreateToken", request)
            self.world.count("front door token requests refused")
            self._judge(code == "INVALID_ARGUMENT", f"token create with {what}: {code} {details!r}")
        # A read token limited to `mine`, short-lived: it reads `mine`'s segments and no
        # other stream's, then expires.
        limited = master_pb2.CreateTokenReply()
        code, details = await self._master_call(
            "CreateToken",
            master_pb2.CreateTokenRequest(
                tenant=tenant, role=read, stream_ids=[ids[mine]], ttl_ms=TOKEN_TTL_MS_MIN
            ),
            limited,
        )
        self._judge(code == "OK", f"token create --stream {mine}: {code} {details!r}")
        if code != "OK":
            return
        async with StreamClient.from_transport(
            self.world.masters.address, Transport(token=limited.token)
        ) as reader:
            code, details = await self._list(reader, mine)
            self._judge(code == "OK", f"a token limited to {mine} listing it: {code} {details!r}")
            if same_tenant:
                code, details = await self._list(reader, same_tenant[0])
                self._judge(
                    code == "PERMISSION_DENIED",
                    f"a token limited to {mine} listing {same_tenant[0]}: {code} {details!r}",
                )
            await asyncio.sleep(TOKEN_TTL_MS_MIN / 1000 + 0.2)
            code, details = await self._list(reader, mine)
            self._judge(code == "UNAUTHENTICATED", f"an expired token: {code} {details!r}")
        self.world.count("front door limited tokens checked")
        # Its revocation, once expired, and a token of a tenant of its own: the master
        # drops expired tokens as it makes and revokes others.
        short = master_pb2.CreateTokenReply()
        code, details = await self._master_call(
            "CreateToken",
            master_pb2.CreateTokenRequest(tenant="e1", role=read, ttl_ms=TOKEN_TTL_MS_MIN),
            short,
        )
        self._judge(code == "OK", f"token create for a new tenant: {code} {details!r}")
        code, details = await self._master_call(
            "RevokeToken", master_pb2.RevokeTokenRequest(token_id=limited.token_id)
        )
        self._judge(code not in UNCLEAR, f"token revoke of an expired token: {code} {details!r}")
        await asyncio.sleep(TOKEN_TTL_MS_MIN / 1000 + 0.2)
        code, details = await self._master_call(
            "CreateToken", master_pb2.CreateTokenRequest(tenant="e1", role=read)
        )
        self._judge(code == "OK", f"token create: {code} {details!r}")

    async def _stranger(self) -> None:
        """A store of another cluster (its disk holds that cluster's id) pointed at this
        master, as a mistyped `--master` does: refused for good, its process ends
        (`WrongCluster`), and the master never counts it among its stores."""
        store = SimStore(
            self.world.network,
            STRANGER,
            master_address=self.world.masters.address,
            # Where the world's stores measure their free space.
            data_dir=next(iter(self.world.stores.values())).data_dir,
        )
        store.kv.write([Put(CLUSTER_ID_KEY, b"another-cluster")], sync=True)
        task = asyncio.get_running_loop().create_task(store.serve(), context=node_context(STRANGER))
        done, _ = await asyncio.wait([task], timeout=STRANGER_S)
        if not done:
            task.cancel()
            await asyncio.wait([task])
        error = None if task.cancelled() else task.exception()
        leaves = error.exceptions if isinstance(error, BaseExceptionGroup) else (error,)
        refused = any(isinstance(leaf, WrongCluster) for leaf in leaves)
        self._judge(refused, f"a store of another cluster, after {STRANGER_S} s: {error!r}")
        state = self.world.masters.state
        taken = state is not None and STRANGER in state.stores
        self._judge(not taken, "a store of another cluster is among the master's stores")
        self.world.count("front door stores of another cluster refused")

    def _backup(self) -> None:
        """`streamengine metadata backup` of the embedded master on RocksDB while it
        runs (`snapshot_records`, a secondary instance of its database): every record
        the master holds at that moment, nothing else."""
        master = self.world.masters.embedded
        if master is None or master.disk is None:
            return
        metadata = master.metadata
        if not isinstance(metadata, RocksDBMetadata):
            return
        backup = snapshot_records(master.disk)
        held = metadata.read_all()
        self.world.count("front door metadata backups")
        self._judge(
            backup == held,
            f"a metadata backup holds {len(backup)} records, the master {len(held)}",
        )

    async def _list(self, client: StreamClient, stream: str) -> tuple[str, str]:
        try:
            await client.master.ListSegments(
                master_pb2.ListSegmentsRequest(stream=stream), timeout=CALL_S
            )
        except grpc.aio.AioRpcError as error:
            return error.code().name, error.details() or ""
        return "OK", ""

    async def _master_call(
        self,
        method: str,
        request: Message,
        reply: Message | None = None,
        transport: Transport | None = None,
    ) -> tuple[str, str]:
        """A call of the serving master's service as the admin (or as `transport`'s
        token): its status (`reply` filled with its answer)."""
        path = f"/streamengine.v1.Master/{method}"
        transport = transport or self.transport
        async with transport.aio_channel(self._master_address()) as typed:
            channel: Any = typed
            try:
                raw = await channel.unary_unary(path)(request.SerializeToString(), timeout=CALL_S)
            except grpc.aio.AioRpcError as error:
                return error.code().name, (error.details() or "")[:200]
        if reply is not None:
            reply.ParseFromString(raw)
        return "OK", ""

    async def _own_stream(self, client: StreamClient) -> None:
        """A stream of its own (`e0/front-door`) led while one of its stores' disk is
        full (`SimStore.disk_full`) and after it is freed, and while the master's signing
        key rotates (`key rotate`): every event acked is read back once, in order, and
        once the disk is free an append is acked again."""
        stream = "e0/front-door"
        policy = self.world.config.policy
        await client.create_stream(stream, policy.replicas, policy.write_quorum)
        acked: list[tuple[int, bytes]] = []
        sent = 0

        async def append(writer: Writer) -> bool:
            nonlocal sent
            sent += 1
            payload = f"front-door:{sent}".encode()
            try:
                sequence = await writer.append(payload)
            except StreamEngineError as error:
                self.world.note(f"front-door: append {sent}: {type(error).__name__}")
                return False
            acked.append((sequence, payload))
            return True

        async with client.writer(
            stream, client_id="front-door", append_timeout_s=OWN_APPEND_S
        ) as writer:
            self._judge(await append(writer), f"the first append to {stream}: not acked")
            await self._too_large(writer)
            segments = await client.list_segments(stream)
            names = sorted(replica.store_id for replica in segments[-1].copy_set)
            store = self.world.stores[self.rng.choice(names)]
            store.disk_full = True
            self.world.note(f"front-door: {store.store_id}'s disk full")
            for _ in range(FULL_APPENDS):
                await append(writer)
                await asyncio.sleep(self.rng.randint(50, 300) / 1000)
            await asyncio.sleep(FULL_S)
            store.disk_full = False
            self.world.note(f"front-door: {store.store_id}'s disk freed")
            self.world.count("front door disks filled and freed")
            code, details = await self._master_call(
                "RotateSigningKey", master_pb2.RotateSigningKeyRequest()
            )
            self._judge(code in ("OK", "RESOURCE_EXHAUSTED"), f"key rotate: {code} {details!r}")
            acked_after = 0
            for _ in range(AFTER_APPENDS):
                acked_after += await append(writer)
                if acked_after >= AFTER_ACKED or not writer.leading:
                    break
                await asyncio.sleep(self.rng.randint(100, 1_000) / 1000)
            recovered = acked_after > 0
            self._judge(recovered, f"{stream}: no append acked once the disk was freed")
        await self._read_back(client, stream, acked)
        await self._trim(client, stream, acked)

    async def _too_large(self, writer: Writer) -> None:
        """An event one byte over the limit, alone and in a batch: `EventTooLarge`,
        nothing sent, and the writer goes on leading."""
        big = b"o" * (EVENT_BYTES_MAX + 1)
        for what, call in (
            ("append", lambda: writer.append(big)),
            ("append_batch", lambda: writer.append_batch([b"small", big])),
        ):
            try:
                await call()
                told = "acked"
            except EventTooLarge:
                told = "EventTooLarge"
            except StreamEngineError as error:
                told = type(error).__name__
            self._judge(told == "EventTooLarge", f"an event over the limit ({what}): {told}")
        self.world.count("front door events over the limit refused")

    async def _trim(
        self, client: StreamClient, stream: str, acked: list[tuple[int, bytes]]
    ) -> None:
        """`streamengine seal` of its stream, `stream trim` of every segment before the
        new one: a follower from 0 is told `Trimmed` (naming the first sequence
        retained (invariant 13)."""
        if not acked:
            return
        try:
            await client.seal(stream)
            segments = await client.list_segments(stream)
        except StreamEngineError as error:
            self.world.note(f"front-door: seal of {stream}: {type(error).__name__}")
            return
        sealed = [segment.epoch for segment in segments if segment.final_index]
        if not sealed:
            return
        before = (max(sealed) + 1) << 32
        trimmed = master_pb2.TrimStreamReply()
        request = master_pb2.TrimStreamRequest(name=stream, before_sequence=before)
        code, details = await self._master_call("TrimStream", request, trimmed)
        self._judge(code == "OK", f"stream trim {stream}: {code} {details!r}")
        if code != "OK":
            return
        told: Trimmed | None = None
        try:
            async with asyncio.timeout(READ_BACK_S):
                async for _event in client.subscribe(stream, 0):
                    break
        except Trimmed as error:
            told = error
        except TimeoutError:
            pass
        self._judge(
            told is not None and told.first_retained_sequence >= before,
            f"a follower of {stream} from 0 after a trim before {before}: told {told!r}",
        )
        self.world.count("front door trims told")
        await self._delete(stream)

    async def _delete(self, stream: str) -> None:
        """`stream delete` of its stream: created again under the name while its removal
        is pending, it is refused (ALREADY_EXISTS), as is a call creating more streams at
        once than the bound (INVALID_ARGUMENT)."""
        code, details = await self._master_call(
            "DeleteStream", master_pb2.DeleteStreamRequest(name=stream)
        )
        self._judge(code == "OK", f"stream delete {stream}: {code} {details!r}")
        policy = self.world.config.policy
        spec = master_pb2.CreateStreamRequest(
            name=stream,
            policy=entry_pb2.ReplicationPolicy(
                replicas=policy.replicas, write_quorum=policy.write_quorum
            ),
        )
        code, details = await self._master_call("CreateStream", spec)
        self._judge(
            code == "ALREADY_EXISTS", f"stream create of {stream}, deleted: {code} {details!r}"
        )
        many = master_pb2.CreateStreamsRequest(
            streams=[
                master_pb2.CreateStreamRequest(name=f"e0/many{n}", policy=spec.policy)
                for n in range(CREATE_STREAMS_PER_CALL_MAX + 1)
            ]
        )
        code, details = await self._master_call("CreateStreams", many)
        self._judge(
            code == "INVALID_ARGUMENT",
            f"{CREATE_STREAMS_PER_CALL_MAX + 1} streams created in one call: {code} {details!r}",
        )

    async def _read_back(
        self, client: StreamClient, stream: str, acked: list[tuple[int, bytes]]
    ) -> None:
        """Every acked event of `stream` read, in order, once."""
        if not acked:
            return
        read: list[tuple[int, bytes]] = []
        last = acked[-1][0]
        try:
            async with asyncio.timeout(READ_BACK_S):
                async for event in client.subscribe(stream):
                    read.append((event.sequence, event.payload))
                    if event.sequence >= last:
                        break
        except TimeoutError:
            pass
        sequences = [sequence for sequence, _ in read]
        self._judge(sequences == sorted(set(sequences)), f"{stream} read out of order: {read}")
        missing = sorted(set(acked) - set(read))
        self._judge(not missing, f"{stream}: acked events never read: {missing[:5]}")
        self.world.count("front door own events read back", len(read))

    # ---- aiming ----

    async def _live(self, client: StreamClient) -> badinput.Live | None:
        """A sealed and the open segment of one of the world's streams, as
        `badinput.live_segments` finds them through the master and a replica."""
        streams = [s for s in self.world.stream_names if s not in self.world.removed]
        for stream in self.rng.sample(streams, len(streams)):
            try:
                listing = await client.master.ListSegments(
                    master_pb2.ListSegmentsRequest(stream=stream), timeout=CALL_S
                )
            except grpc.aio.AioRpcError:
                continue
            sealed = [x for x in listing.segments if x.state == entry_pb2.SEALED]
            if not sealed or not sealed[-1].copy_set or not listing.segments[-1].copy_set:
                continue
            last_sealed, last = sealed[-1], listing.segments[-1]
            replica = last_sealed.copy_set[0]
            async with self.transport.aio_channel(replica.address) as channel:
                try:
                    state = await store_grpc.SegmentStoreStub(channel).GetSegmentState(
                        s.GetSegmentStateRequest(
                            segment=entry_pb2.SegmentId(
                                stream_id=listing.stream_id, epoch=last_sealed.id.epoch
                            )
                        ),
                        timeout=CALL_S,
                    )
                except grpc.aio.AioRpcError:
                    continue
            if state.fence < 2:
                continue
            return badinput.Live(
                badinput.Segment(
                    stream,
                    listing.stream_id,
                    last_sealed.id.epoch,
                    last_sealed.final_index,
                    replica.address,
                    state.fence,
                    replica.data_address,
                ),
                badinput.Segment(
                    stream,
                    listing.stream_id,
                    last.id.epoch,
                    0,
                    last.copy_set[0].address,
                    0,
                    last.copy_set[0].data_address,
                ),
            )
        return None

    # ---- the rows ----

    async def _rows(self, live: badinput.Live) -> None:
        methods = {(server, method.name): method for server, method in badinput.methods()}
        rows = [row for row in badinput.ROWS if not row.tls_only]
        for row in self.rng.sample(rows, len(rows)):
            request = self._request(row, live)
            if request is None:
                continue
            target = live.sealed if row.segment == "sealed" else live.open
            address = self._master_address() if row.server == "master" else target.address
            method = methods[(row.server, row.method)]
            code, details = await self._call(address, target.data_address, method, request)
            self.world.note(f"front-door: {row.case}: {code}")
            self.world.count("front door rows answered")
            expected = row.expected.name
            if row.server == "store" and self._moved_away(target, code):
                continue
            self._judge(
                code in (expected, *self._excused(row)),
                f"{row.case} ({row.method} at the {row.server}): {code} {details!r}, "
                f"expected {expected}",
            )

    def _request(self, row: badinput.Row, live: badinput.Live) -> Message | list[Message] | None:
        """The row's request against this world (None: the row does not apply to it)."""
        if row.case == "existing stream, other policy":
            # The row names another policy than the stream's: this world's may be 3/3.
            policy = self.world.config.policy
            other = (3, 2) if (policy.replicas, policy.write_quorum) != (3, 2) else (3, 3)
            return master_pb2.CreateStreamRequest(
                name=live.open.stream,
                policy=entry_pb2.ReplicationPolicy(replicas=other[0], write_quorum=other[1]),
            )
        return row.request(live)

    @staticmethod
    def _excused(row: badinput.Row) -> tuple[str, ...]:
        """Statuses a row may get beside its own in this world."""
        return ()

    async def _own_rows(self, live: badinput.Live) -> None:
        """Requests beside `badinput.ROWS`, each with the statuses it may get:
        `streamengine verify`'s certified digests, a reader's report of a replica (its
        store checks it: sound, it stays), reads and digests of ranges no replica has."""
        sealed, opened = live.sealed.pb, live.open.pb
        reading = (s.ReadRequest(segment=sealed, from_index=3, to_index=2), ("INVALID_ARGUMENT",))
        rows: list[tuple[str, str, str, Message, tuple[str, ...]]] = [
            (
                "verify's certified digest of a sealed replica",
                "store",
                "Digest",
                s.DigestRequest(
                    segment=sealed, up_to_index=live.sealed.final_index, certificate=True
                ),
                # DATA_LOSS: a replica rot reached that the scrub has not found yet.
                ("OK", "DATA_LOSS"),
            ),
            (
                "a certified digest of the open segment's acked entries",
                "open",
                "Digest",
                s.DigestRequest(segment=opened, certificate=True),
                # INVALID_ARGUMENT: nothing acked there yet; NOT_FOUND: a segment just
                # rolled, whose first write has not reached this replica yet.
                ("OK", "INVALID_ARGUMENT", "NOT_FOUND"),
            ),
            (
                "a certified digest of a segment not held",
                "store",
                "Digest",
                s.DigestRequest(segment=badinput._fuzz_segment(), up_to_index=1, certificate=True),
                ("NOT_FOUND",),
            ),
            (
                "a digest past the last index any segment can have",
                "store",
                "Digest",
                s.DigestRequest(segment=sealed, up_to_index=1 << 62),
                ("INVALID_ARGUMENT",),
            ),
            (
                "a reader's report of a sealed replica",
                "master",
                "ReportReplica",
                master_pb2.ReportReplicaRequest(
                    stream=live.sealed.stream,
                    segment_epoch=live.sealed.epoch,
                    store_address=live.sealed.address,
                    problem="front door: a report of a sound replica",
                ),
                ("OK",),
            ),
            (
                "a reader's report of a stream nobody has",
                "master",
                "ReportReplica",
                master_pb2.ReportReplicaRequest(
                    stream=badinput.FUZZ_STREAM, segment_epoch=2, store_address="x:1"
                ),
                ("NOT_FOUND",),
            ),
            ("a read ending before it begins", "store", "Read", *reading),
            (
                "a lease session too short to be unguessed",
                "master",
                "HoldLeaseSession",
                master_pb2.HoldLeaseSessionRequest(session=b"x" * 8),
                ("INVALID_ARGUMENT",),
            ),
            (
                "a packed read of a sealed replica, an entry per reply",
                "store",
                "Read",
                s.ReadRequest(segment=sealed, from_index=1, packed=True, max_entries_per_reply=1),
                ("OK", "DATA_LOSS"),
            ),
            (
                "a read of a sealed replica's acked entries, an entry per reply",
                "store",
                "Read",
                s.ReadRequest(
                    segment=sealed, from_index=1, acked_only=True, max_entries_per_reply=1
                ),
                ("OK", "DATA_LOSS"),
            ),
            (
                "a batch of one seal without its grant",
                "master",
                "SealSegments",
                master_pb2.SealSegmentsRequest(
                    seals=[
                        master_pb2.SealSegmentRequest(
                            stream=live.sealed.stream,
                            segment_epoch=live.open.epoch,
                            writer_epoch=live.sealed.epoch,
                            final_index=1,
                        )
                    ]
                ),
                # Answered whole: the seal's own refusal is in its entry (below).
                ("OK",),
            ),
        ]
        methods = {(server, method.name): method for server, method in badinput.methods()}
        for case, server, name, request, expected in rows:
            target = live.open if server == "open" else live.sealed
            server = "store" if server == "open" else server
            address = self._master_address() if server == "master" else target.address
            method = methods[(server, name)]
            code, details = await self._call(address, target.data_address, method, request)
            self.world.note(f"front-door: {case}: {code}")
            self.world.count("front door own rows answered")
            if name == "SealSegments" and code == "OK":
                await self._seal_entry_refused(request)
            if server == "store" and self._moved_away(target, code):
                continue
            wanted = " or ".join(expected)
            self._judge(code in expected, f"{case}: {code} {details!r}, expected {wanted}")

    def _moved_away(self, target: badinput.Segment, code: str) -> bool:
        """Whether a store answered NOT_FOUND for a replica it no longer holds: the
        master's repairer may move a sealed replica while the front door knocks (found
        by seed 183: store1's replica of 2/2 moved to store0 as the calls began; seed 30
        shows it since followers read the list again at a replica's bridge)."""
        if code != "NOT_FOUND":
            return False
        key = SegmentKey(target.stream_id, target.epoch)
        for store in self.world.stores.values():
            core = store.core
            if (
                store.address == target.address
                and core is not None
                and core.catalog.meta(key) is None
            ):
                self.world.count("front door: a replica moved away")
                return True
        return False

    async def _seal_entry_refused(self, request: Message) -> None:
        """A batch of seals without their grants: each entry PERMISSION_DENIED."""
        reply = master_pb2.SealSegmentsReply()
        code, _ = await self._master_call("SealSegments", request, reply)
        denied = grpc.StatusCode.PERMISSION_DENIED.value[0]
        entries = [(entry.code, entry.message[:80]) for entry in reply.seals]
        self._judge(
            code != "OK" or [c for c, _ in entries] == [denied],
            f"a batch of one seal without its grant: entries {entries}",
        )

    async def _as_another_tenant(self, live: badinput.Live) -> None:
        """A write token of a tenant of its own (`e1`) acting on the world's stream:
        its lease, roll and seal refused (PERMISSION_DENIED), in the batches too."""
        made = master_pb2.CreateTokenReply()
        request = master_pb2.CreateTokenRequest(tenant="e1", role=master_pb2.TOKEN_ROLE_WRITE)
        code, details = await self._master_call("CreateToken", request, made)
        self._judge(code == "OK", f"token create for e1: {code} {details!r}")
        if code != "OK":
            return
        stranger = Transport(token=made.token)
        stream, sealed, opened = live.open.stream, live.sealed, live.open
        beat = master_pb2.WriterHeartbeatRequest(stream=stream, client_id="e1-writer")
        roll = master_pb2.RollSegmentRequest(stream=stream, client_id="e1", epoch=opened.epoch)
        seal = master_pb2.SealSegmentRequest(
            stream=stream,
            segment_epoch=opened.epoch,
            writer_epoch=sealed.epoch,
            final_index=1,
        )
        # (method, request, the batch's reply and its entries' field, or None).
        calls: list[tuple[str, Message, tuple[Message, str] | None]] = [
            ("WriterHeartbeat", beat, None),
            (
                "LeaseHeartbeat",
                master_pb2.LeaseHeartbeatRequest(leases=[beat]),
                (master_pb2.LeaseHeartbeatReply(), "leases"),
            ),
            ("RollSegment", roll, None),
            (
                "RollSegments",
                master_pb2.RollSegmentsRequest(rolls=[roll]),
                (master_pb2.RollSegmentsReply(), "rolls"),
            ),
            ("SealSegment", seal, None),
            (
                "SealSegments",
                master_pb2.SealSegmentsRequest(seals=[seal]),
                (master_pb2.SealSegmentsReply(), "seals"),
            ),
        ]
        denied = grpc.StatusCode.PERMISSION_DENIED.value[0]
        for method, call, batch in calls:
            reply = batch[0] if batch is not None else None
            code, details = await self._master_call(method, call, reply, stranger)
            self.world.count("front door calls of another tenant")
            what = f"{method} of {stream} by a write token of e1: {code} {details!r}"
            if batch is not None and code == "OK":
                # A batch is answered whole: each entry carries its own refusal.
                entries = [entry.code for entry in getattr(batch[0], batch[1])]
                self._judge(entries == [denied], f"{what}, entries {entries}")
            else:
                self._judge(code == "PERMISSION_DENIED", what)

    async def _tails(self, live: badinput.Live) -> None:
        """Multiplexed Subscribe calls (the SDK's followers of many) that name a tail
        twice, a tail 0 after the first, a segment not held, or stop a tail never
        started: the call goes on, each bad tail ended with its status (a segment not
        held is waited for)."""

        def start(tail: int, segment: entry_pb2.SegmentId) -> s.SubscribeRequest:
            return s.SubscribeRequest(
                start=s.SubscribeStart(segment=segment, from_index=1, tail=tail)
            )

        sealed, fuzz = live.sealed.pb, badinput._fuzz_segment()
        calls: list[tuple[str, list[s.SubscribeRequest], dict[int, str]]] = [
            ("a tail named twice", [start(1, sealed), start(1, sealed)], {1: "INVALID_ARGUMENT"}),
            (
                "a tail 0 after the first",
                [start(2, sealed), start(0, sealed)],
                {0: "INVALID_ARGUMENT"},
            ),
            # A tail waits for a segment not held yet (a writer's first batch may reach
            # its store after a follower): the call goes on.
            ("a tail of a segment not held", [start(3, fuzz)], {}),
            (
                "a stop of a tail never started",
                [start(4, sealed), s.SubscribeRequest(stop=s.SubscribeStop(tail=9))],
                {},
            ),
            # One segment's tail (no tail number), its client closing its side.
            ("a tail closed by its client", [start(0, sealed)], {}),
        ]
        for case, requests, expected in calls:
            code, ended = await self._subscribe(live.sealed.data_address, requests)
            self.world.note(f"front-door: {case}: {code}, tails ended {ended}")
            self.world.count("front door multiplexed calls answered")
            if code in NOT_THROUGH:
                continue
            self._judge(
                code == "OK" and all(ended.get(t) == c for t, c in expected.items()),
                f"{case}: {code}, tails ended {ended}, expected {expected}",
            )

    async def _subscribe(
        self, data_address: str, requests: list[s.SubscribeRequest]
    ) -> tuple[str, dict[int, str]]:
        """A multiplexed Subscribe on a store's data plane: its requests sent, its
        replies read for `TAIL_WAIT_S`, then its side closed; how the call ended and
        the tails the store ended, with their statuses."""
        ended: dict[int, str] = {}
        codes = {c.value[0]: c.name for c in grpc.StatusCode}

        async def replies(opened: Any) -> None:
            while (reply := await opened.receive()) is not None:
                if reply.HasField("ended"):
                    ended[reply.tail] = codes.get(reply.ended.code, str(reply.ended.code))

        try:
            async with framed.connect(data_address, self.transport) as connection:
                opened = await connection.call(framing.SUBSCRIBE)
                for request in requests:
                    await opened.send_parts([request.SerializeToString()])
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(TAIL_WAIT_S):
                        await replies(opened)
                await opened.end()
                async with asyncio.timeout(CALL_S):
                    await replies(opened)
        except framed.CallError as error:
            return codes.get(error.code, str(error.code)), ended
        except TimeoutError:
            return "DEADLINE_EXCEEDED", ended
        return "OK", ended

    def _master_address(self) -> str:
        """The serving master's address (with masters on etcd, the active one)."""
        masters = self.world.masters
        if masters.embedded is not None:
            return masters.embedded.address
        active = masters.active()
        return active[0].address if active else masters.elected[0].address

    # ---- the fuzz ----

    async def _fuzz(self) -> None:
        methods = sorted(
            badinput.methods(), key=lambda pair: (pair[0], pair[1].name, type(pair[1]).__name__)
        )
        templates = badinput.fuzz_templates()
        stores = sorted(self.world.stores.values(), key=lambda store: store.store_id)
        for _ in range(FUZZ_CALLS):
            server, method = self.rng.choice(methods)
            data, mutated = badinput.fuzzed_request(
                self.rng, method, templates, badinput.NOT_MUTATED
            )
            parses = badinput.parses(method, data)
            store = self.rng.choice(stores)
            address = self._master_address() if server == "master" else store.address
            code, details = await self._call(address, store.data_address, method, [data])
            kind = "mutated" if mutated else "random"
            self.world.count(f"front door {kind} requests answered")
            what = f"{kind} {method.name} at the {server} ({data.hex()}): {code} {details!r}"
            if not parses:
                self._judge(code == "INVALID_ARGUMENT", f"{what}, expected INVALID_ARGUMENT")
            else:
                streaming = method.server_streaming and code == "DEADLINE_EXCEEDED"
                self._judge(code not in UNCLEAR or streaming, f"{what}: never {UNCLEAR}")

    # ---- calls ----

    async def _call(
        self,
        address: str,
        data_address: str,
        method: Any,
        request: Message | list[Message] | list[bytes],
    ) -> tuple[str, str]:
        """One call with the request's bytes: its status's name and details."""
        payloads = [
            r if isinstance(r, bytes) else r.SerializeToString()
            for r in (request if isinstance(request, list) else [request])
        ]
        if isinstance(method, badinput.DataMethod):
            return await badinput.data_exchange(self.transport, data_address, method, payloads)
        path = f"/{method.containing_service.full_name}/{method.name}"
        async with self.transport.aio_channel(address) as typed:
            # Untyped: grpc's stubs type a multicallable without serializers as taking
            # nothing.
            channel: Any = typed
            try:
                if method.server_streaming:
                    call = channel.unary_stream(path)(payloads[0], timeout=CALL_S)
                    async for _ in call:
                        pass
                else:
                    await channel.unary_unary(path)(payloads[0], timeout=CALL_S)
            except grpc.aio.AioRpcError as error:
                return error.code().name, (error.details() or "")[:200]
        return "OK", ""

    # ---- judging ----

    def _judge(self, ok: bool, what: str) -> None:
        def refused() -> None:
            if not ok:
                raise Violation(6, f"front door: {what}")

        self.world.check(refused)

    def _look(
        self,
    ) -> tuple[dict[str, tuple[int, int, int]], dict[tuple[str, SegmentKey], Replica]]:
        """The master's streams (id, policy) and what every store holds of each replica."""
        streams = {}
        state = self.world.masters.state
        if state is not None:
            for name, record in state.streams.items():
                streams[name] = (record.stream_id, record.replicas, record.write_quorum)
        replicas = {}
        for name, store in sorted(self.world.stores.items()):
            core = store.core
            if core is None:
                continue
            for key, meta in sorted(core.catalog.metas().items()):
                segment = state.segments.get((key.stream_id, key.epoch)) if state else None
                final = segment.final_index if segment is not None else 0
                complete = bool(meta.fence) and final > 0 and meta.last_index == final
                up_to = meta.last_index if complete else meta.acked_index
                digest = self._digest(name, key, up_to)
                replicas[(name, key)] = Replica(meta.fence, up_to, digest, complete)
        return streams, replicas

    def _digest(self, store: str, key: SegmentKey, up_to: int) -> bytes:
        """The digest of `store`'s replica of `key` up to `up_to` (b"": not held, or
        nothing to digest; a copy under way holds nothing yet)."""
        core = self.world.stores[store].core
        if up_to == 0 or core is None or core.catalog.meta(key) is None:
            return b""
        try:
            return core.reader.digest(key, up_to).digest
        except CorruptEntry:  # rot the scrub has not found yet
            return b"damaged"

    def _unchanged(
        self,
        before: tuple[dict[str, tuple[int, int, int]], dict[tuple[str, SegmentKey], Replica]],
        after: tuple[dict[str, tuple[int, int, int]], dict[tuple[str, SegmentKey], Replica]],
    ) -> None:
        """What the front door's callers were refused changed nothing: no stream of
        theirs, none changed, no replica touched. Meanwhile repair may add and remove
        replicas, and leaders roll their segments by age: of a replica held before and
        after, what it held is compared, and its fence if it was sealed whole (another
        one's fence may rise, below the last epoch, which only a seal without a grant
        would reach: seed 796 saw store2's replica that missed its bridge refilled)."""

        streams_before, replicas_before = before
        streams_after, replicas_after = after
        for name, was in sorted(streams_before.items()):
            now = streams_after.get(name)
            self._judge(now in (None, was), f"stream {name} was {was}, is {now}")
        # Well-formed requests of the fuzz namespace may create its tenant and streams;
        # nothing else may appear.
        tenants = {name.split("/")[0] for name in streams_before}
        for name in sorted(set(streams_after) - set(streams_before)):
            self._judge(name.split("/")[0] not in tenants, f"stream {name} appeared")
        for (store, key), held in sorted(replicas_before.items()):
            holds = replicas_after.get((store, key))
            if holds is None:
                continue
            digest = self._digest(store, key, held.up_to)
            if held.complete:
                fence_kept = holds.fence == held.fence
            else:
                fence_kept = held.fence <= holds.fence < EPOCH_MAX
            self._judge(
                digest == held.digest and fence_kept,
                f"{store}'s replica of {key} was {held}, is {holds} (digest {digest.hex()})",
            )
        self.world.count("front door looks compared")
