"""PySpark data source `streamengine`: sealed segments for analytics, acked events
for Structured Streaming.

    from streamengine.client.spark import register
    register(spark)
    df = (spark.read.format("streamengine")
          .option("master", "127.0.0.1:7070").option("stream", "acme/orders").load())

One row per EVENT (holes and bridges never appear), schema
`stream string, epoch int, index long, sequence long, payload binary`.

Which streams: `stream` (one), `streams` (names separated by commas) or `prefix` (every
stream whose name starts with it when the scan is planned, such as "acme/"), exactly
one of them; the `stream` column names each row's. A batch scan of many streams plans
each one's segments as for one (the same `fromSequence`/`toSequence` bounding each),
then balances all of them into partitions together: a partition may hold several small
streams' ranges, or a piece of a large one. Streaming over many streams keeps each
stream's sequence in its offsets (`maxEventsPerTrigger` bounding each stream), and a
stream created under the prefix joins at its first event.

Batch options: `fromSequence` (inclusive) and `toSequence` (exclusive) bound the range;
`includeOpen` (default false) adds the open segment up to its acked index;
`partitionEntries` (default 500000): the scan is cut into as few partitions of at most
that many entries as it fits in, of about equal size, spanning segments (cut at a
segment's end, or in a certified segment at a chunk's end, where that is nearest and
keeps them within it);
`skipLostRanges` (default false): a range an operator sealed
accepting loss (`streamengine seal --accept-loss`) is read around instead of failing
the query with `DataLossError`.
Streaming options: `startingSequence` (default 0), `maxEventsPerTrigger` (default none).
Secured clusters (reading, both): `certsDir` (a certs dir with the cluster's `ca.crt`, read on the
driver) and `token`, the driver's credentials. Executors get none of them: only the CA
and a read token limited to the job's streams (one per tenant), in the partitions. A
driver that is a cluster admin (`client.root` in `certsDir`, no `token`) mints those
for `executorTokenTtlMs` (default an hour; a streaming query mints another when half of
it is left); `executorToken` gives one instead (`streamengine token create --role read
--stream NAME`); a driver holding a tenant token, and neither, hands its own token on.
The `token` option is dropped from the data source once its reader holds it, and the
readers leave the driver's credentials out of their pickled form.

Planning (driver side) asks the master for the segments; an input partition holds
ranges of segments, each with the segment's certificate when it has one.
Each range is read in an executor from a replica whose acked index covers it, over its
own gRPC channel, failing over to the next replica, and checked to hold exactly the
indexes it planned: a short read is an error, never silently fewer rows. Under a
certificate a range is read in the whole chunks that cover it, and every chunk is checked
against it before any of its rows leave (`streamengine.protocol.certificate`, over the packed
columns: no object per row); a replica that differs, or fails a read with DATA_LOSS, is
damaged for the partition, reported to the master, and the next replica is read from
that chunk on. Which replica next, how long to back off a failed one, and when a range
is lost follow the followers' rules (`streamengine.client.core.replicas`): a replica that fails
may be restarting and is retried; only replicas answering that they hold less or are
damaged (on a copy set the master still lists) make a `DataLossError`. Rows leave as
Arrow record batches.

Writing (batch): `df.write.format("streamengine").option("master", M).option("stream",
S).option("producerId", P).mode("append").save()` appends the `payload` column (binary,
or string as UTF-8) of every row. Each task leads the stream in turn (one writer at a
time) and appends its partition's rows in batches of `WRITE_BATCH_ROWS`, with the
producer id `P.PARTITION` and the row's position in the partition as its producer
sequence: a task retried, or the same job run again over the same partitions, finds its
rows in the stream and appends nothing new (`Writer.append_batch`). Without
`producerId` every run appends again. A task takes its rows in a thread, so that its
writer's heartbeats go on while a slow stage before it makes them.

Writing (streaming): `df.writeStream.format("streamengine").option("master", M)
.option("stream", S).option("checkpointLocation", C).start()` appends every row once
across task retries and query restarts from C. Each task's producer id is
`QUERY_ID.PARTITION` (the query's id, kept in its checkpoint) and each row's producer
sequence is `batch id * STREAM_BATCH_ROWS_MAX + its position in the partition`
(`stream_sequence_of`): a micro-batch run again after a restart, or a task retried,
holds the same rows at the same sequences and appends nothing new. Sequences jump from
batch to batch, which the writer accepts (`sequence_jumps`).

Secured clusters (writing, both): `certsDir` and `token` as for reading. The executors
get the CA and a token that may write the stream, never a private key: a cluster
admin's driver mints a write token of the stream's tenant for `executorTokenTtlMs` (the
master limits only read tokens to streams, so it may write every stream of that
tenant), `executorToken` gives one instead, and a tenant's driver hands its own token
on. A token that cannot write the stream (a read token, another tenant's) is refused
on the driver before any task runs. The token is minted when PySpark first pickles
the writer for its tasks (PySpark makes a streaming query's writer again for each
commit, which mints nothing), so a streaming query's token lives `executorTokenTtlMs`
from the query's start: a query meant to run longer sets a longer one or gives
`executorToken` (restarted from its checkpoint, a query mints another). The `token`
option is dropped from the data source once its writer holds it.

Streaming offsets are `{"sequence": N}`: everything below N was handed to Spark. Only
acked entries are read, and acked entries never change, so a query restarted from its
checkpoint re-reads the same rows for the same offsets.

Why one long module: it is the data source Spark loads by name on the driver and on every
executor; the driver's planning and the executors' reads share the partition types Spark
pickles between them. The rules it shares with followers are in `client.core.replicas`
and `client.packed`.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import dataclasses
import itertools
import logging
import time
from collections.abc import Generator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import grpc
import pyarrow as pa
from pyspark.sql.datasource import (
    DataSource,
    DataSourceReader,
    DataSourceStreamReader,
    DataSourceStreamWriter,
    DataSourceWriter,
    InputPartition,
    WriterCommitMessage,
)
from pyspark.sql.types import BinaryType, StringType, StructType

from streamengine.client.core.multiplex import Selection
from streamengine.client.core.replicas import (
    Ask,
    FollowerTiming,
    Lost,
    Relist,
    ReplicaSet,
    WaitUntil,
)
from streamengine.client.core.subscription import Asked, Unreachable, open_acked_index
from streamengine.client.errors import DataLossError, InvalidArgument, Unavailable, from_rpc_error
from streamengine.client.packed import EVENT_FIELDS, Packed, event_columns, one_batch
from streamengine.protocol import codec, framed_read, loop_thread
from streamengine.protocol.auth import Role
from streamengine.protocol.certificate import (
    Certificate,
    CertificateMismatch,
    ChunkCheck,
    MalformedCertificate,
)
from streamengine.protocol.clock import monotonic_ms
from streamengine.protocol.entry import (
    PRODUCER_SEQUENCE_MAX,
    EntryKind,
    InvalidProducer,
    check_producer_id,
)
from streamengine.protocol.framed import CallError
from streamengine.protocol.framing import StatusCode
from streamengine.protocol.limits import INDEX_MAX
from streamengine.protocol.master_calls import SyncMasters, sync_masters
from streamengine.protocol.sequence import pack_sequence, unpack_sequence
from streamengine.protocol.signing import SignatureRefused
from streamengine.protocol.tokens import TOKEN_TTL_MS_MAX, TOKEN_TTL_MS_MIN, unverified_claims
from streamengine.protocol.transport import PLAINTEXT, Transport, TransportError, tls_problem
from streamengine.v1 import entry_pb2, master_pb2, segment_store_pb2
from streamengine.v1 import segment_store_pb2_grpc as store_grpc

SOURCE_NAME = "streamengine"
# No column is ever null; saying so spares Spark a null check per value.
SCHEMA = (
    "stream string not null, epoch int not null, index long not null,"
    " sequence long not null, payload binary not null"
)
ARROW_SCHEMA = pa.schema([pa.field("stream", pa.string(), nullable=False), *EVENT_FIELDS])
# Each partition is a Spark task, and a task costs Spark's JVM tens of milliseconds of
# CPU beyond its rows: 500 k entries (50 MB of 100-byte events, Spark's own split for
# files being 128 MB) scan faster than 250 k (docs/performance.md, "Spark scan").
PARTITION_ENTRIES_DEFAULT = 500_000
# Rows per Arrow batch handed to Spark: large batches amortise the per-batch cost.
ARROW_BATCH_ROWS = 65_536
RPC_TIMEOUT_S = 30.0
REPORT_TIMEOUT_S = 5.0
# A partition whose replicas all keep failing (none answering what it holds) for this
# long fails its task as Unavailable, for Spark to retry: never as data loss.
PARTITION_UNREADABLE_S_MAX = 300.0

# The partition numbers a producer id of a write task may end with (`P.PARTITION`).
PARTITIONS_MAX = 1_000_000
# Rows a write task appends as one batch (one producer batch): large enough that a
# batch's round trip is shared by many rows, small enough to hold in a task.
WRITE_BATCH_ROWS = 1000
# A streaming write's producer sequence is batch id * this + the row's position in its
# partition: a micro-batch's partition holds fewer rows, and 2**31 batches fit below
# PRODUCER_SEQUENCE_MAX.
STREAM_BATCH_ROWS_MAX = 1 << 32
# Where Spark's micro-batch execution tells each task its query and batch (local
# properties: StreamExecution.QUERY_ID_KEY, MicroBatchExecution.BATCH_ID_KEY).
QUERY_ID_PROPERTY = "sql.streaming.queryId"
BATCH_ID_PROPERTY = "streaming.sql.batchId"

# Executors' tokens live an hour by default: long enough for most scans, short enough
# that one taken off an executor dies soon.
EXECUTOR_TOKEN_TTL_MS_DEFAULT = 3600 * 1000
# Options holding the driver's credentials (keys as PySpark's case-insensitive options
# give them): the data source drops them once its reader holds them.
DRIVER_CREDENTIAL_OPTIONS = ("token", "executortoken")

READ, WRITE = master_pb2.TOKEN_ROLE_READ, master_pb2.TOKEN_ROLE_WRITE

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SegmentRange(InputPartition):
    """Indexes `first..last` (inclusive) of one segment; plain data, it is pickled."""

    stream: str
    stream_id: int
    epoch: int
    first_index: int
    last_index: int
    replicas: tuple[str, ...]
    # Where to re-read the copy set when every planned replica says it holds less.
    master: str = ""
    # How the executor reaches the stores (TLS credentials and token, as bytes).
    transport: Transport = PLAINTEXT
    # The segment's certificate, encoded (`Certificate.encode`); empty when it has none.
    certificate: bytes = b""
    # Replicas the master knows to differ from the certificate: never read.
    bad: tuple[str, ...] = ()
    # Where each replica serves the data plane: (its gRPC address, its data address).
    data_addresses: tuple[tuple[str, str], ...] = ()
    # False: planned from an open segment, up to the index its replicas said was acked.
    sealed: bool = True


@dataclass(frozen=True)
class ScanPartition(InputPartition):
    """One Spark task's share of a scan: ranges of consecutive segments, read in turn."""

    ranges: tuple[SegmentRange, ...]

    @property
    def entries(self) -> int:
        return sum(r.last_index - r.first_index + 1 for r in self.ranges)


@dataclass(frozen=True)
class _SegmentInfo:
    epoch: int
    sealed: bool
    final_index: int
    replicas: tuple[str, ...]
    certificate: Certificate | None = None
    bad: tuple[str, ...] = ()
    # Sealed accepting loss: acked events from this index through the bridge may be
    # lost (0: none).
    lost_from_index: int = 0
    # Where each replica serves the data plane: (its gRPC address, its data address).
    data_addresses: tuple[tuple[str, str], ...] = ()
    # The largest acked index the master knows (it trails the stores' answers).
    acked_index: int = 0

    @property
    def seal_certificate(self) -> Certificate | None:
        """The certificate a read of this segment is checked against: this seal's, if
        it is sealed and has one."""
        certificate = self.certificate if self.sealed else None
        if certificate is None or certificate.final_index != self.final_index:
            return None
        return certificate


@dataclass(frozen=True)
class _StreamLayout:
    stream_id: int
    segments: tuple[_SegmentInfo, ...]
    # Per open segment: the largest acked index any replica reports.
    open_acked: dict[int, int]


def _option_int(options: dict[str, str], name: str, default: int | None) -> int | None:
    raw = options.get(name.lower())
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise InvalidArgument(f"option {name} must be an integer, got {raw!r}") from None


def _required(options: dict[str, str], name: str) -> str:
    value = options.get(name.lower(), "")
    if not value:
        raise InvalidArgument(f"option {name!r} is required")
    return value


class _Credentials:
    """The driver's credentials (never pickled: `_DriverSide`) and the transport it
    hands its executors (module doc)."""

    def __init__(self, options: dict[str, str]) -> None:
        self.certs_dir = options.get("certsdir", "")
        self.token = options.get("token", "")
        self.executor_token = options.get("executortoken", "")
        ttl = _option_int(options, "executorTokenTtlMs", EXECUTOR_TOKEN_TTL_MS_DEFAULT)
        self.executor_ttl_ms = ttl or EXECUTOR_TOKEN_TTL_MS_DEFAULT
        if not TOKEN_TTL_MS_MIN <= self.executor_ttl_ms <= TOKEN_TTL_MS_MAX:
            raise InvalidArgument(f"executorTokenTtlMs {self.executor_ttl_ms} out of range")
        # Per tenant: (transport, the stream ids its token reads, until when).
        self._minted: dict[str, tuple[Transport, tuple[int, ...], int]] = {}
        self.driver()  # a certs dir that cannot serve fails at once

    def driver(self) -> Transport:
        """How the driver calls, read from the certs dir now."""
        try:
            return Transport.for_client(
                Path(self.certs_dir) if self.certs_dir else None, self.token
            )
        except TransportError as error:
            raise InvalidArgument(str(error)) from None

    def executors(self, master: str, stream: str, stream_id: int) -> Transport:
        """How executors call to read `stream`: the CA and a token, never a private key."""
        return self.executors_for(master, {stream: stream_id})[stream]

    def executors_for(self, master: str, streams: dict[str, int]) -> dict[str, Transport]:
        """How executors call to read each of `streams` (name -> id): a minted token
        reads the streams of one tenant, so there is one per tenant."""
        driver = self.driver()
        if not driver.tls:
            return dict.fromkeys(streams, PLAINTEXT)
        if self.executor_token:
            return dict.fromkeys(streams, Transport(driver.ca_pem, token=self.executor_token))
        if not driver.cert_pem:
            return dict.fromkeys(streams, Transport(driver.ca_pem, token=driver.token))
        tenants: dict[str, list[str]] = {}
        for name in sorted(streams):
            tenants.setdefault(name.split("/", 1)[0], []).append(name)
        transports: dict[str, Transport] = {}
        for tenant, names in tenants.items():
            ids = tuple(sorted(streams[name] for name in names))
            minted, ttl_ms = self._minted.get(tenant), self.executor_ttl_ms
            left_ms = minted[2] - int(time.time() * 1000) if minted is not None else 0
            if minted is None or minted[1] != ids or left_ms < ttl_ms // 2:
                token, until_ms = _mint_token(master, driver, tenant, READ, ids, ttl_ms)
                minted = (Transport(driver.ca_pem, token=token), ids, until_ms)
                self._minted[tenant] = minted
            transports |= dict.fromkeys(names, minted[0])
        return transports

    def writers(self, master: str, stream: str) -> Transport:
        """How executors call to write `stream`: the CA and a token that may write it,
        never a private key. A minted one is a write token of the stream's tenant for
        `executor_ttl_ms`: the master limits only read tokens to streams."""
        driver = self.driver()
        if not driver.tls:
            return PLAINTEXT
        if self.executor_token:
            return Transport(driver.ca_pem, token=self.executor_token)
        if not driver.cert_pem:
            return Transport(driver.ca_pem, token=driver.token)
        tenant = stream.split("/", 1)[0]
        token, _ = _mint_token(master, driver, tenant, WRITE, (), self.executor_ttl_ms)
        return Transport(driver.ca_pem, token=token)

    def check_writes(self, stream: str) -> None:
        """Refuse now, in words, a token that every task's writer would be refused with
        (a read token, another tenant's): the servers decide, this only says it early."""
        driver = self.driver()
        if not driver.tls or (driver.cert_pem and not self.executor_token):
            return  # plaintext, or a cluster admin who mints a write token
        option = "executorToken" if self.executor_token else "token"
        token = self.executor_token or driver.token
        if not token:
            raise InvalidArgument(
                f"writing to {stream} on a secured cluster needs a token that may write it"
                " (option token or executorToken), or client.root in certsDir"
            )
        try:
            claims = unverified_claims(token)
        except SignatureRefused as error:
            raise InvalidArgument(f"option {option}: {error}") from None
        tenant = stream.split("/", 1)[0]
        if claims.tenant != tenant:
            raise InvalidArgument(
                f"option {option}: a token of tenant {claims.tenant} cannot write {stream}"
            )
        if claims.role < Role.WRITE:
            raise InvalidArgument(
                f"option {option}: a {claims.role.name.lower()} token cannot write {stream};"
                " give a write token (streamengine token create --role write)"
            )


def _mint_token(
    master: str,
    driver: Transport,
    tenant: str,
    role: master_pb2.TokenRole.ValueType,
    stream_ids: tuple[int, ...],
    ttl_ms: int,
) -> tuple[str, int]:
    """(token, expiry) of a `role` token of `tenant` (limited to `stream_ids` when it
    names any), made by the driver as a cluster admin."""
    with sync_masters(master, driver) as masters:
        try:
            reply = masters.stub.CreateToken(
                master_pb2.CreateTokenRequest(
                    tenant=tenant,
                    role=role,
                    ttl_ms=ttl_ms,
                    stream_ids=list(stream_ids),
                ),
                timeout=RPC_TIMEOUT_S,
            )
        except grpc.RpcError as error:
            raise from_rpc_error(error) from error
    log.info(
        "%s: minted %s token %s of %s for the executors",
        tenant,
        master_pb2.TokenRole.Name(role),
        reply.token_id,
        f"{len(stream_ids)} streams" if stream_ids else "every stream",
    )
    return reply.token, reply.expires_at_ms


class _DriverSide:
    """A reader whose pickled form (what executors get) leaves out `_credentials`."""

    _credentials: _Credentials

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.pop("_credentials", None)
        return state


def fetch_layout(
    master_address: str,
    stream: str,
    with_open_acked: bool,
    transport: Transport = PLAINTEXT,
    from_epoch: int = 0,
    to_epoch: int = 0,
) -> _StreamLayout:
    """The stream's segments (from `from_epoch` to `to_epoch`, 0: no bound), sealed ones
    with their certificates, and for open ones the acked index their replicas serve."""
    with sync_masters(master_address, transport) as masters:
        return _layout_of(
            masters, master_address, stream, with_open_acked, transport, from_epoch, to_epoch
        )


def fetch_layouts(
    master_address: str, streams: list[str], with_open_acked: bool, transport: Transport
) -> dict[str, _StreamLayout]:
    """`fetch_layout` of each of `streams`, over one connection to the masters."""
    with sync_masters(master_address, transport) as masters:
        return {
            name: _layout_of(masters, master_address, name, with_open_acked, transport)
            for name in streams
        }


def _layout_of(
    masters: SyncMasters,
    master_address: str,
    stream: str,
    with_open_acked: bool,
    transport: Transport,
    from_epoch: int = 0,
    to_epoch: int = 0,
) -> _StreamLayout:
    try:
        reply = masters.stub.ListSegments(
            master_pb2.ListSegmentsRequest(
                stream=stream, from_epoch=from_epoch, to_epoch=to_epoch, certificates=True
            ),
            timeout=RPC_TIMEOUT_S,
        )
    except grpc.RpcError as error:
        _raise_master_error(error, master_address, transport)
    segments = tuple(segment_info(segment) for segment in reply.segments)
    open_acked: dict[int, int] = {}
    if with_open_acked:
        for segment in segments:
            if not segment.sealed:
                open_acked[segment.epoch] = _open_acked(stream, reply.stream_id, segment, transport)
    return _StreamLayout(reply.stream_id, segments, open_acked)


def _raise_master_error(error: grpc.RpcError, master: str, transport: Transport) -> NoReturn:
    problem = tls_problem(error.details() or "", transport.tls)
    if error.code() == grpc.StatusCode.UNAVAILABLE and problem:
        raise Unavailable(f"master at {master}: {problem}") from error
    raise from_rpc_error(error) from error


def stream_names(master_address: str, selection: Selection, transport: Transport) -> list[str]:
    """The streams a scan reads, in name order: those named, or those the master lists
    under the prefix now (deleted ones left out)."""
    if selection.prefix is None:
        return sorted(selection.names)
    with sync_masters(master_address, transport) as masters:
        try:
            reply = masters.stub.ListStreams(
                master_pb2.ListStreamsRequest(tenant=selection.tenant), timeout=RPC_TIMEOUT_S
            )
        except grpc.RpcError as error:
            _raise_master_error(error, master_address, transport)
    return sorted(
        s.name for s in reply.streams if selection.covers(s.name) and not s.deleted_until_ms
    )


def selection_of(options: dict[str, str]) -> Selection:
    """The streams a reader names: `stream`, `streams` (comma-separated) or `prefix`,
    exactly one of them."""
    given = [name for name in ("stream", "streams", "prefix") if options.get(name)]
    if len(given) != 1:
        raise InvalidArgument("name exactly one of the options stream, streams and prefix")
    if given == ["prefix"]:
        return Selection(prefix=options["prefix"])
    names = tuple(name.strip() for name in options[given[0]].split(",") if name.strip())
    try:
        return Selection(names)
    except ValueError as error:
        raise InvalidArgument(f"option {given[0]}: {error}") from None


def segment_info(segment: entry_pb2.Segment) -> _SegmentInfo:
    certificate = None
    if segment.certificate.chunks:
        try:
            certificate = codec.certificate_from_pb(segment.certificate)
        except MalformedCertificate:
            log.warning("segment %d: the master listed a malformed certificate", segment.id.epoch)
    bad = set(segment.bad_stores)
    return _SegmentInfo(
        epoch=segment.id.epoch,
        sealed=segment.state == entry_pb2.SEALED,
        final_index=segment.final_index,
        replicas=tuple(replica.address for replica in segment.copy_set),
        certificate=certificate,
        bad=tuple(r.address for r in segment.copy_set if r.store_id in bad),
        lost_from_index=segment.lost_from_index,
        acked_index=segment.acked_index,
        data_addresses=tuple((r.address, r.data_address) for r in segment.copy_set),
    )


def _open_acked(stream: str, stream_id: int, segment: _SegmentInfo, transport: Transport) -> int:
    """The acked index of open `segment` (`core.subscription.open_acked_index`): a scan
    to it must not end short because its stores did not answer."""
    first_ms = monotonic_ms()
    timing = FollowerTiming()
    while True:
        answers = [_replica_acked(stream_id, segment.epoch, a, transport) for a in segment.replicas]
        asked = Asked(answers, first_ms, monotonic_ms())
        acked = open_acked_index(
            segment.epoch, segment.replicas, segment.acked_index, asked, timing
        )
        if isinstance(acked, Unreachable):
            raise Unavailable(acked.describe(stream))
        if isinstance(acked, int):
            return acked
        time.sleep(max(acked.until_ms - monotonic_ms(), 0) / 1000)


def _replica_acked(stream_id: int, epoch: int, address: str, transport: Transport) -> int | None:
    """What the replica at `address` says it acked of segment `epoch` (0: it holds none
    of it), or None when it does not answer."""
    with transport.channel(address) as channel:
        try:
            state = store_grpc.SegmentStoreStub(channel).GetSegmentState(
                segment_store_pb2.GetSegmentStateRequest(
                    segment=entry_pb2.SegmentId(stream_id=stream_id, epoch=epoch)
                ),
                timeout=5,
            )
        except grpc.RpcError as error:
            return 0 if error.code() == grpc.StatusCode.NOT_FOUND else None
    return int(state.acked_index)


def plan_ranges(
    stream: str,
    layout: _StreamLayout,
    start_sequence: int,
    end_sequence: int | None,
    include_open: bool,
    master: str = "",
    transport: Transport = PLAINTEXT,
    skip_lost: bool = False,
    load: dict[str, int] | None = None,
) -> list[SegmentRange]:
    """Ranges covering `[start_sequence, end_sequence)` of readable events, one per
    segment (`balance` cuts them into Spark's partitions). A range a segment was sealed without
    (`--accept-loss`) raises `DataLossError`, as for every reader, unless `skip_lost`:
    then it is read around."""
    ranges: list[SegmentRange] = []
    # Entries each store is asked to serve so far (by the scan's other streams too):
    # every range starts at its least loaded replica (the rest are its fail-over
    # order), so a scan spreads evenly.
    load = {} if load is None else load
    for segment in layout.segments:
        if segment.sealed:
            last_readable = segment.final_index - 1  # the BRIDGE is not an event
        elif include_open:
            last_readable = layout.open_acked.get(segment.epoch, 0)
        else:
            continue
        first = 1
        start_epoch, start_index = unpack_sequence(start_sequence)
        if segment.epoch < start_epoch:
            continue
        if segment.epoch == start_epoch:
            first = max(first, start_index)
        if end_sequence is not None:
            end_epoch, end_index = unpack_sequence(end_sequence)
            if segment.epoch > end_epoch:
                break
            if segment.epoch == end_epoch:
                last_readable = min(last_readable, end_index - 1)
        lost_from = segment.lost_from_index if segment.sealed else 0
        # The scan reaches the lost range when it reads past `lost_from - 1` (to the
        # end of the segment, or into the range).
        if lost_from and last_readable >= min(lost_from, segment.final_index - 1):
            if not skip_lost:
                raise DataLossError(stream, segment.epoch, lost_from, segment.final_index, True)
            last_readable = min(last_readable, lost_from - 1)
        entries = last_readable - first + 1
        if entries <= 0:
            continue
        certificate = segment.seal_certificate
        encoded = certificate.encode() if certificate is not None else b""
        replicas = _least_loaded_first(segment.replicas, load)
        if replicas:
            load[replicas[0]] = load.get(replicas[0], 0) + entries
        ranges.append(
            SegmentRange(
                stream,
                layout.stream_id,
                segment.epoch,
                first,
                last_readable,
                replicas,
                master,
                transport,
                encoded,
                segment.bad,
                segment.data_addresses,
                segment.sealed,
            )
        )
    return ranges


def plan_streams(
    layouts: dict[str, _StreamLayout],
    start_sequence: int,
    end_sequence: int | None,
    include_open: bool,
    master: str = "",
    transports: dict[str, Transport] | None = None,
    skip_lost: bool = False,
) -> list[SegmentRange]:
    """`plan_ranges` of each stream, in name order, the same sequence bounds applying to
    each; its replicas' load is counted across the streams. `balance` then cuts them
    with no regard to streams: a partition may hold the ranges of many small streams,
    or a piece of one large one, so that a scan of 10,000 streams of a few events is a
    few tasks, not 10,000."""
    load: dict[str, int] = {}
    ranges: list[SegmentRange] = []
    for name in sorted(layouts):
        transport = (transports or {}).get(name, PLAINTEXT)
        ranges += plan_ranges(
            name,
            layouts[name],
            start_sequence,
            end_sequence,
            include_open,
            master,
            transport,
            skip_lost,
            load,
        )
    return ranges


def balance(ranges: list[SegmentRange], partition_entries: int) -> list[ScanPartition]:
    """Spark's input partitions: `ranges` (in stream order, one per segment) cut into
    ceil(total / partition_entries) partitions of about equal size; a partition may
    span segments. Spark's cost per task is tens of ms, so fewer tasks scan faster, and
    equal ones leave no core idle at the end (three segments of a third each, on two
    cores, kept one core idle a third of the scan).

    Each cut goes to the nearest segment end, or under a certificate to the nearest end
    of a chunk (a range reads the whole chunks around it: a chunk cut in two is read
    and checked twice), as long as no partition then holds more than
    `partition_entries`; otherwise it stays where equal sizes put it."""
    assert partition_entries > 0
    sizes = [r.last_index - r.first_index + 1 for r in ranges]
    assert all(size > 0 for size in sizes), sizes
    total = sum(sizes)
    if total == 0:
        return []
    count = -(-total // partition_entries)
    offsets = list(itertools.accumulate(sizes, initial=0))  # entries before each range
    cuts = [0]  # entries before each partition, then the total
    for part in range(1, count):
        ideal = part * total // count
        following = (part + 1) * total // count if part + 1 < count else total
        candidates = sorted(_cut_candidates(ranges, offsets, ideal), key=lambda c: abs(c - ideal))
        cut = next(
            (
                c
                for c in candidates
                if cuts[-1] < c < following
                and c - cuts[-1] <= partition_entries
                and following - c <= partition_entries
            ),
            ideal,
        )
        cuts.append(cut)
    cuts.append(total)
    partitions: list[ScanPartition] = []
    pieces_cut = [0] * len(ranges)  # pieces of each range so far
    for low, high in itertools.pairwise(cuts):  # entries [low, high) of the scan
        pieces: list[SegmentRange] = []
        for position, (r, offset, size) in enumerate(zip(ranges, offsets[:-1], sizes, strict=True)):
            begin, end = max(low, offset), min(high, offset + size)
            if begin < end:
                # Each piece of a split segment starts at the next replica in turn, so
                # that the tasks reading one large segment spread over its stores.
                turn = pieces_cut[position] % max(len(r.replicas), 1)
                pieces_cut[position] += 1
                pieces.append(
                    dataclasses.replace(
                        r,
                        first_index=r.first_index + begin - offset,
                        last_index=r.first_index + end - offset - 1,
                        replicas=r.replicas[turn:] + r.replicas[:turn],
                    )
                )
        partitions.append(ScanPartition(tuple(pieces)))
    assert sum(p.entries for p in partitions) == total
    return partitions


def _cut_candidates(ranges: list[SegmentRange], offsets: list[int], ideal: int) -> list[int]:
    """Where a cut near `ideal` (entries from the scan's start) costs nothing: the ends
    of the range holding it, and under a certificate the ends of its chunk there."""
    position = bisect.bisect_right(offsets, ideal) - 1
    if position >= len(ranges):
        return [offsets[-1]]
    r, offset = ranges[position], offsets[position]
    found = []
    if r.certificate:
        index = r.first_index + ideal - offset
        chunk_first, chunk_last = Certificate.decode(r.certificate).chunk_of(index)
        found += [  # the chunk's own end first: it wins a tie
            offset + end - r.first_index + 1
            for end in (chunk_last, chunk_first - 1)
            if r.first_index - 1 < end < r.last_index
        ]
    return [*found, offset, offsets[position + 1]]


def _least_loaded_first(replicas: tuple[str, ...], load: dict[str, int]) -> tuple[str, ...]:
    """The copy set rotated to start at the replica with the least load (the earliest
    in copy set order among equals)."""
    if not replicas:
        return replicas
    turn = min(range(len(replicas)), key=lambda position: load.get(replicas[position], 0))
    return replicas[turn:] + replicas[:turn]


def read_range(part: SegmentRange) -> Iterator[pa.RecordBatch]:
    """Arrow batches of the events in `part`, failing over between replicas.

    Every index of the range must come back (EVENT or HOLE) from some replica's acked
    entries. A replica that fails is retried with backoff; one that serves less than
    the range (or NOT_FOUND) answered that it holds less. When every replica of a copy
    set the master still lists said so of a sealed segment, the rest is a
    DataLossError naming it; of an open one, they are asked again until they serve it
    (their acked indexes grow) or the segment is sealed, and after
    `PARTITION_UNREADABLE_S_MAX` of nothing the task fails as Unavailable. Replies are
    packed (values back to back, verified by the store), so no Python object is made
    per row."""
    next_index = part.first_index
    errors: list[str] = []
    replicas = ReplicaSet()
    sealed = part.sealed
    if sealed:
        replicas.segment_sealed()
    for bad in part.bad:  # the master knows them to differ from the certificate
        replicas.damaged(bad, 1)
    certificate = Certificate.decode(part.certificate) if part.certificate else None
    # A range planned open: a replica's bridge says the segment was sealed since.
    bridge_unlisted = certificate is None and not sealed and bool(part.master)
    copy_set = part.replicas
    data_addresses = dict(part.data_addresses)
    deadline = time.monotonic() + PARTITION_UNREADABLE_S_MAX
    while next_index <= part.last_index:
        choice = replicas.choose(copy_set, sealed, next_index, monotonic_ms())
        if isinstance(choice, Relist):
            # Without the master's address (a partition planned by an older driver) the
            # planned copy set is the only list there is.
            if part.master:
                listed = _listed_now(part)
                copy_set = listed.replicas
                data_addresses.update(listed.data_addresses)
            replicas.list_refreshed()
            continue
        if isinstance(choice, Lost):
            raise DataLossError(part.stream, part.epoch, next_index, part.last_index) from (
                RuntimeError("; ".join(errors)) if errors else None
            )
        if isinstance(choice, WaitUntil):
            if time.monotonic() > deadline:
                raise Unavailable(f"{part.stream}: segment {part.epoch}: " + "; ".join(errors))
            time.sleep(max(choice.until_ms - monotonic_ms(), 0) / 1000)
            continue
        assert isinstance(choice, Ask)
        start = next_index
        # A replica no list named a data port for is unreachable: its read fails at once.
        replica = _Replica(choice.replica, data_addresses.get(choice.replica, ""))
        if certificate is not None:
            read = _read_certified(part, certificate, replica, start, replicas, errors)
        else:
            read = _read_replica(part, replica, start, replicas, errors, bridge_unlisted)
        try:
            with contextlib.closing(read):
                for batch, after in read:
                    next_index = after
                    if batch.num_rows:
                        yield batch
        except _SealedSince:
            # The replica holds the bridge of a segment planned open: what it holds is
            # at rest, which only the certificate guards. Ask the master for it once;
            # if it still lists the segment open (a seal not recorded yet, no
            # certificate), the range is read under crc32c as planned.
            bridge_unlisted = False
            listed = _listed_now(part)
            copy_set = listed.replicas
            data_addresses.update(listed.data_addresses)
            if listed.sealed:
                sealed = True
                replicas.segment_sealed()
            certificate = listed.seal_certificate
            continue
        if next_index > start:
            deadline = time.monotonic() + PARTITION_UNREADABLE_S_MAX
        elif not sealed:
            # An open segment's replica that serves less than the range does not know
            # its acked index yet (the leader's next Write, or the master, tells it), or
            # the segment is being sealed: never a loss while it is open.
            replicas.passed_over(choice.replica, monotonic_ms())
            if all(replicas.below(replica, next_index) for replica in copy_set):
                if time.monotonic() > deadline:
                    raise Unavailable(
                        f"{part.stream}: segment {part.epoch} is open and no replica "
                        f"serves index {next_index} yet: " + "; ".join(errors[-3:])
                    )
                time.sleep(FollowerTiming().segment_refresh_ms / 1000)
                if part.master:
                    listed = _listed_now(part)
                    copy_set, sealed = listed.replicas, listed.sealed
                    data_addresses.update(listed.data_addresses)
                    if sealed:
                        replicas.segment_sealed()
                replicas.list_refreshed()


@dataclass(frozen=True)
class _Replica:
    """A replica as a read names it: its gRPC address (what the replica rules and the
    master's reports know it by) and its data port (where it is read)."""

    address: str
    data_address: str

    def read(
        self, part: SegmentRange, request: segment_store_pb2.ReadRequest
    ) -> Generator[segment_store_pb2.ReadReply, None, None]:
        return framed_read.read_sync(self.data_address, part.transport, request, RPC_TIMEOUT_S)


def _read_replica(
    part: SegmentRange,
    replica: _Replica,
    next_index: int,
    replicas: ReplicaSet,
    errors: list[str],
    bridge_unlisted: bool = False,
) -> Generator[tuple[pa.RecordBatch, int], None, None]:
    """Read `part` from `next_index` on one replica; each batch with the index after it.
    What the replica answers, or that it failed, goes to `replicas`. With
    `bridge_unlisted` (a range planned open), a replica whose first reply says it holds
    a bridge past `next_index` ends the read with `_SealedSince`, before any row."""
    address = replica.address
    request = segment_store_pb2.ReadRequest(
        segment=entry_pb2.SegmentId(stream_id=part.stream_id, epoch=part.epoch),
        from_index=next_index,
        to_index=part.last_index,
        acked_only=True,
        packed=True,
    )
    with contextlib.closing(replica.read(part, request)) as replies:
        pending: list[pa.RecordBatch] = []
        try:
            for reply in replies:
                if bridge_unlisted and reply.bridge_index > next_index:
                    raise _SealedSince(reply.bridge_index)
                bridge_unlisted = False  # the first reply says; the rest are the same read
                batch, next_index = _packed_batch(part, reply, next_index)
                if batch is not None:
                    pending.append(batch)
                if sum(b.num_rows for b in pending) >= ARROW_BATCH_ROWS:
                    yield one_batch(pending), next_index
                    pending = []
            # The read ended: the replica serves no more (its acked index).
            replicas.answered(address, next_index - 1)
        except CallError as error:
            _read_failed(part, address, next_index, error, replicas, errors)
        except _ShortRead as short:
            errors.append(f"{address}: {short}")
            replicas.answered(address, next_index - 1)
        if pending:  # rows verified so far: the next replica resumes after them
            yield one_batch(pending), next_index


def _read_failed(
    part: SegmentRange,
    address: str,
    next_index: int,
    error: CallError,
    replicas: ReplicaSet,
    errors: list[str],
) -> None:
    """A read that ended with an error: NOT_FOUND and DATA_LOSS are answers (it holds
    nothing, or what it holds from `next_index` is damaged: C14), the rest failures."""
    code = error.code
    errors.append(f"{address}: {code.name}")
    if code == StatusCode.NOT_FOUND:
        replicas.answered(address, 0)
    elif code == StatusCode.DATA_LOSS:
        replicas.damaged(address, next_index)
        _report(part, address, f"DATA_LOSS from index {next_index}: {error.details}")
    else:
        log.info("%s: replica %s failed: %s", part.stream, address, code.name)
        replicas.failed(address, monotonic_ms())


def _read_certified(
    part: SegmentRange,
    certificate: Certificate,
    replica: _Replica,
    next_index: int,
    replicas: ReplicaSet,
    errors: list[str],
) -> Generator[tuple[pa.RecordBatch, int], None, None]:
    """`_read_replica` under a certificate: the read covers whole chunks (from the one
    holding `next_index` to the one holding the partition's last index), each chunk is
    checked over the packed columns, and only rows of verified chunks leave, each batch
    with the index after it. A chunk that differs makes the replica damaged from there
    for this partition, and the master hears of it."""
    check = ChunkCheck(certificate, next_index)
    read_last = certificate.chunk_of(part.last_index)[1]
    held: list[Packed] = []
    address = replica.address
    request = segment_store_pb2.ReadRequest(
        segment=entry_pb2.SegmentId(stream_id=part.stream_id, epoch=part.epoch),
        from_index=check.next_index,
        to_index=read_last,
        acked_only=True,
        packed=True,
        reader_verifies=True,
    )
    with contextlib.closing(replica.read(part, request)) as replies:
        try:
            for reply in replies:
                packed = Packed.of(reply)
                if packed is None:
                    continue
                if packed.first_index != check.next_index:
                    raise _ShortRead(
                        f"expected index {check.next_index}, replica sent {packed.first_index}"
                    )
                mismatch: CertificateMismatch | None = None
                try:
                    verified = packed.feed(check)
                except CertificateMismatch as error:
                    # The chunks before the one that differs verified: they leave, so
                    # that the next read starts at the chunk that differs.
                    verified, mismatch = check.verified_through, error
                held.append(packed)
                ready, held = _verified_rows(part, held, verified, next_index)
                if ready is not None:
                    next_index = min(verified, part.last_index) + 1
                    for batch in ready:
                        yield batch, next_index
                if mismatch is not None:
                    raise mismatch
            replicas.answered(address, _certified_answer(check, next_index))
        except CertificateMismatch as mismatch:
            errors.append(f"{address}: {mismatch}")
            replicas.damaged(address, mismatch.first_index)
            _report(part, address, str(mismatch))
        except CallError as error:
            _read_failed(part, address, next_index, error, replicas, errors)
        except _ShortRead as short:
            errors.append(f"{address}: {short}")
            replicas.answered(address, _certified_answer(check, next_index))


def _certified_answer(check: ChunkCheck, next_index: int) -> int:
    """Where a replica's certified read says it serves to: where its rows verified
    (`next_index` is the index after them), not where its acked entries went. A
    replica whose acked index ends inside a chunk (a member that missed the bridge,
    until repair refills it) serves none of that chunk, and is asked again only after
    the others (runtime seed 377: asked again at once, for ever)."""
    return next_index - 1


def _verified_rows(
    part: SegmentRange, held: list[Packed], verified: int, next_index: int
) -> tuple[list[pa.RecordBatch] | None, list[Packed]]:
    """Rows of the held replies up to `verified` and within the partition from
    `next_index` on, a batch per reply (not concatenated: a chunk of 100-byte events
    ends inside a reply, and joining its two parts copied every row once more); the
    replies (or their parts) still to verify."""
    low = max(next_index, part.first_index)
    high = min(verified, part.last_index)
    batches = []
    keep = []
    for packed in held:
        first, last = max(low, packed.first_index), min(high, packed.last_index)
        if first <= last:
            indexes, payloads = packed.columns(
                first - packed.first_index, last - packed.first_index + 1
            )
            batches.append(_record_batch(part, indexes, payloads))
        if packed.last_index > verified:
            keep.append(packed)
    if verified < next_index:
        return None, keep
    return (batches or [_empty(part)]), keep


def _empty(part: SegmentRange) -> pa.RecordBatch:
    return _record_batch(part, pa.array([], pa.int64()), pa.array([], pa.binary()))


def _record_batch(part: SegmentRange, indexes: pa.Array, payloads: pa.Array) -> pa.RecordBatch:
    stream = pa.repeat(pa.scalar(part.stream, pa.string()), len(indexes))
    return pa.RecordBatch.from_arrays(
        [stream, *event_columns(part.epoch, indexes, payloads)], schema=ARROW_SCHEMA
    )


def _report(part: SegmentRange, address: str, problem: str) -> None:
    """Tell the master a replica served what it must not (best effort: a hint)."""
    log.warning("%s: segment %d: replica %s: %s", part.stream, part.epoch, address, problem)
    if not part.master:
        return
    with sync_masters(part.master, part.transport) as masters:
        try:
            masters.stub.ReportReplica(
                master_pb2.ReportReplicaRequest(
                    stream=part.stream,
                    segment_epoch=part.epoch,
                    store_address=address,
                    problem=problem[:500],
                ),
                timeout=REPORT_TIMEOUT_S,
            )
        except grpc.RpcError as error:
            log.info("%s: the master did not take the report: %s", part.stream, error.code().name)


def _listed_now(part: SegmentRange) -> _SegmentInfo:
    """The segment as the master lists it now: its copy set, its members' data ports,
    whether it is sealed (a segment no longer listed is: trimmed or deleted) and its
    certificate."""
    layout = fetch_layout(part.master, part.stream, False, part.transport)
    for segment in layout.segments:
        if segment.epoch == part.epoch:
            return segment
    return _SegmentInfo(part.epoch, sealed=True, final_index=0, replicas=())


def read_partition(partition: InputPartition) -> Iterator[pa.RecordBatch]:
    """What a reader's `read` yields. With no partitions planned (an empty range),
    PySpark still reads one placeholder InputPartition: it holds no rows."""
    if isinstance(partition, ScanPartition):
        for part in partition.ranges:
            yield from read_range(part)


class _ShortRead(Exception):
    pass


class _SealedSince(Exception):
    """A replica holds the bridge (at `args[0]`) of a segment the range was planned
    open in."""


def _packed_batch(
    part: SegmentRange, reply: segment_store_pb2.ReadReply, next_index: int
) -> tuple[pa.RecordBatch | None, int]:
    """Check that the reply continues exactly at `next_index`; return its EVENT rows as
    one Arrow batch and the index expected next.

    A range of a sealed segment ends before its BRIDGE: one inside it is another seal
    (`_ShortRead`). A range of a segment open when planned may end at one: a recovery
    sealing the segment raises its replicas' acked index to its bridge before the master
    records the seal, so the acked index the plan took may be the bridge's, and nothing
    acked follows it. The range is read to its end there."""
    packed = Packed.of(reply)
    if packed is None:
        return None, next_index
    if packed.first_index != next_index:
        raise _ShortRead(f"expected index {next_index}, replica sent {packed.first_index}")
    if EntryKind.BRIDGE in packed.kinds:
        if part.sealed:
            raise _ShortRead(f"segment {part.epoch} ends before index {part.last_index}")
        before_bridge = packed.kinds.index(EntryKind.BRIDGE)
        indexes, payloads = packed.columns(0, before_bridge)
        return _record_batch(part, indexes, payloads), part.last_index + 1
    indexes, payloads = packed.columns(0, len(packed.kinds))
    return _record_batch(part, indexes, payloads), packed.last_index + 1


class StreamEngineBatchReader(_DriverSide, DataSourceReader):
    def __init__(self, options: dict[str, str]) -> None:
        # Plain data only: the reader is pickled to the executors (without credentials).
        self.master = _required(options, "master")
        self.selection = selection_of(options)
        self._credentials = _Credentials(options)
        self.start_sequence = _option_int(options, "fromSequence", 0) or 0
        self.end_sequence = _option_int(options, "toSequence", None)
        self.include_open = options.get("includeopen", "false").lower() == "true"
        entries = _option_int(options, "partitionEntries", PARTITION_ENTRIES_DEFAULT)
        self.partition_entries = max(1, entries or PARTITION_ENTRIES_DEFAULT)
        if self.end_sequence is not None and self.end_sequence < self.start_sequence:
            raise InvalidArgument("toSequence is below fromSequence")
        self.skip_lost = options.get("skiplostranges", "false").lower() == "true"

    def partitions(self) -> list[ScanPartition]:
        credentials = self._credentials
        driver = credentials.driver()
        names = stream_names(self.master, self.selection, driver)
        layouts = fetch_layouts(self.master, names, self.include_open, driver)
        ids = {name: layout.stream_id for name, layout in layouts.items()}
        whole = plan_streams(
            layouts,
            self.start_sequence,
            self.end_sequence,
            self.include_open,
            self.master,
            credentials.executors_for(self.master, ids) if ids else {},
            self.skip_lost,
        )
        return balance(whole, self.partition_entries)

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        return read_partition(partition)


class StreamEngineStreamReader(_DriverSide, DataSourceStreamReader):
    """Structured Streaming over one stream (offsets `{"sequence": N}`) or many
    (`{"sequences": {name: N}}`: each stream's own; a stream created under the prefix
    later joins at 0)."""

    def __init__(self, options: dict[str, str]) -> None:
        self.master = _required(options, "master")
        self.selection = selection_of(options)
        self.single = options.get("stream", "") != ""
        self._credentials = _Credentials(options)
        self.starting_sequence = _option_int(options, "startingSequence", 0) or 0
        self.max_events = _option_int(options, "maxEventsPerTrigger", None)
        self.partition_entries = PARTITION_ENTRIES_DEFAULT

    def initialOffset(self) -> dict[str, Any]:
        if self.single:
            return {"sequence": self.starting_sequence}
        names = stream_names(self.master, self.selection, self._credentials.driver())
        return {"sequences": dict.fromkeys(names, self.starting_sequence)}

    def latestOffset(self, start: dict[str, Any], limit: Any) -> dict[str, Any]:
        begins = self._sequences(start)
        driver = self._credentials.driver()
        names = stream_names(self.master, self.selection, driver)
        layouts = fetch_layouts(self.master, names, True, driver)
        ends: dict[str, int] = {}
        for name, layout in layouts.items():
            # A stream the offset does not name was created since: it joins at 0.
            begin = begins.get(name, 0 if start else self.starting_sequence)
            end = acked_end(layout)
            if self.max_events is not None:  # per stream
                end = _limit_end(layout, begin, end, self.max_events)
            ends[name] = max(begin, end)
        return self._offset(ends)

    def partitions(self, start: dict[str, Any], end: dict[str, Any]) -> list[ScanPartition]:
        begins, finishes = self._sequences(start), self._sequences(end)
        moved = {name for name, finish in finishes.items() if finish > begins.get(name, 0)}
        if not moved:
            return []
        credentials = self._credentials
        layouts = fetch_layouts(self.master, sorted(moved), True, credentials.driver())
        ids = {name: layout.stream_id for name, layout in layouts.items()}
        executors = credentials.executors_for(self.master, ids)
        load: dict[str, int] = {}
        whole: list[SegmentRange] = []
        for name in sorted(moved):
            whole += plan_ranges(
                name,
                layouts[name],
                begins.get(name, 0),
                finishes[name],
                True,
                self.master,
                executors[name],
                load=load,
            )
        return balance(whole, self.partition_entries)

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        return read_partition(partition)

    def commit(self, end: dict[str, Any]) -> None:
        """Nothing to release: offsets live in Spark's checkpoint."""

    def _sequences(self, offset: dict[str, Any]) -> dict[str, int]:
        """Each stream's sequence in `offset` (either form)."""
        if not offset:
            return {}
        if "sequence" in offset:
            (name,) = self.selection.names
            return {name: int(offset["sequence"])}
        return {name: int(sequence) for name, sequence in offset["sequences"].items()}

    def _offset(self, sequences: dict[str, int]) -> dict[str, Any]:
        if self.single:
            (name,) = self.selection.names
            return {"sequence": sequences.get(name, self.starting_sequence)}
        return {"sequences": dict(sorted(sequences.items()))}


def acked_end(layout: _StreamLayout) -> int:
    """The sequence just past the last acked event."""
    end = 0
    for segment in layout.segments:
        if segment.sealed:
            end = pack_sequence(segment.epoch, segment.final_index)
        else:
            end = pack_sequence(segment.epoch, layout.open_acked.get(segment.epoch, 0) + 1)
            break  # nothing after the open segment is acked yet
    return end


def _limit_end(layout: _StreamLayout, begin: int, end: int, max_events: int) -> int:
    """Move `end` back so that `[begin, end)` spans at most `max_events` indexes."""
    budget = max_events
    for segment in layout.segments:
        first = pack_sequence(segment.epoch, 1)
        last = (
            pack_sequence(segment.epoch, segment.final_index)
            if segment.sealed
            else pack_sequence(
                segment.epoch, min(INDEX_MAX, layout.open_acked.get(segment.epoch, 0) + 1)
            )
        )
        low = max(first, begin)
        high = min(last, end)
        if high <= low:
            continue
        if high - low >= budget:
            return low + budget
        budget -= high - low
    return end


@dataclass(frozen=True)
class PartitionWritten(WriterCommitMessage):
    """What one write task did: the rows of its partition, appended or found in the
    stream already."""

    partition: int
    rows: int


class StreamEngineBatchWriter(_DriverSide, DataSourceWriter):
    """`df.write.format("streamengine")`: see the module docstring."""

    def __init__(self, options: dict[str, str], schema: StructType, overwrite: bool) -> None:
        if overwrite:
            raise InvalidArgument("the streamengine source only appends: use mode('append')")
        self.master = _required(options, "master")
        self.stream = _required(options, "stream")
        self._credentials = _Credentials(options)
        self._credentials.check_writes(self.stream)
        # How the tasks call, made when the writer is first pickled for them: PySpark
        # also makes a streaming query's writer again on the driver for each commit,
        # which must mint nothing.
        self.transport: Transport | None = None
        self.producer_id = options.get("producerid", "")
        if self.producer_id:
            try:
                check_producer_id(f"{self.producer_id}.{PARTITIONS_MAX}")
            except InvalidProducer as error:
                raise InvalidArgument(f"producerId: {error}") from None
        if "payload" not in schema.fieldNames():
            raise InvalidArgument("writing needs a `payload` column (binary or string)")
        kind = schema["payload"].dataType
        if not isinstance(kind, BinaryType | StringType):
            raise InvalidArgument(f"the `payload` column is {kind.simpleString()}, not binary")

    def __getstate__(self) -> dict[str, Any]:
        self.executors()
        return super().__getstate__()

    def executors(self) -> Transport:
        """How the tasks call (module docstring, "Secured clusters")."""
        if self.transport is None:
            self.transport = self._credentials.writers(self.master, self.stream)
        return self.transport

    def write(self, iterator: Iterator[Any]) -> PartitionWritten:
        from pyspark import TaskContext

        context = TaskContext.get()
        partition = context.partitionId() if context is not None else 0
        producer_id = f"{self.producer_id}.{partition}" if self.producer_id else None
        rows = loop_thread.run(
            _write_rows(self.master, self.executors(), self.stream, producer_id, iterator)
        )
        return PartitionWritten(partition, rows)


def stream_sequence_of(batch_id: int, position: int) -> int:
    """The producer sequence of row `position` of a partition in micro-batch
    `batch_id` (module docstring, "Writing (streaming)")."""
    if not 0 <= position < STREAM_BATCH_ROWS_MAX:
        raise InvalidArgument(f"a micro-batch partition of more than {STREAM_BATCH_ROWS_MAX} rows")
    if not 0 <= batch_id <= PRODUCER_SEQUENCE_MAX // STREAM_BATCH_ROWS_MAX - 1:
        raise InvalidArgument(f"micro-batch {batch_id} is past the producer sequences")
    return batch_id * STREAM_BATCH_ROWS_MAX + position


class StreamEngineStreamWriter(DataSourceStreamWriter):
    """`df.writeStream.format("streamengine")`: see the module docstring."""

    def __init__(self, options: dict[str, str], schema: StructType) -> None:
        self.sink = StreamEngineBatchWriter(options, schema, overwrite=False)
        if self.sink.producer_id:
            raise InvalidArgument(
                "a streaming write takes its producer ids from the query's id: no producerId"
            )

    def write(self, iterator: Iterator[Any]) -> PartitionWritten:
        from pyspark import TaskContext

        context = TaskContext.get()
        assert context is not None, "a streaming write runs in a task"
        query_id = context.getLocalProperty(QUERY_ID_PROPERTY)
        batch_id = context.getLocalProperty(BATCH_ID_PROPERTY)
        if not query_id or batch_id is None:
            raise InvalidArgument("a streaming write outside a micro-batch query")
        partition = context.partitionId()
        producer_id = f"{query_id}.{partition}"
        first = stream_sequence_of(int(batch_id), 0)
        sink = self.sink
        rows = loop_thread.run(
            _write_rows(sink.master, sink.executors(), sink.stream, producer_id, iterator, first)
        )
        return PartitionWritten(partition, rows)

    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        """Nothing to do: each row was appended, once, by its task."""

    def abort(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        """Nothing to undo: the batch's rows appended so far are found, not appended
        again, when Spark runs it again."""


async def _write_rows(
    master: str,
    transport: Transport,
    stream: str,
    producer_id: str | None,
    rows: Iterator[Any],
    first_sequence: int = 0,
) -> int:
    """Append the rows' payloads in batches; with a producer id, row N of the partition
    is its producer sequence `first_sequence` + N (a streaming write's sequences jump
    from one micro-batch's first to the next). Returns the rows."""
    from streamengine.client.stream_client import StreamClient

    written = 0
    jumps = first_sequence > 0
    async with (
        StreamClient.from_transport(master, transport) as client,
        client.writer(stream, producer_id=producer_id, sequence_jumps=jumps) as w,
    ):
        # Taken in a thread: Spark hands the rows over as fast as the stages before
        # make them (a slow UDF), and the writer's heartbeats must go on meanwhile or
        # its lease runs out.
        while payloads := await asyncio.to_thread(_next_payloads, rows):
            if producer_id is None:
                await w.append_batch(payloads)
            else:
                await w.append_batch(payloads, producer_sequence=first_sequence + written)
            written += len(payloads)
    return written


def _next_payloads(rows: Iterator[Any]) -> list[bytes]:
    """The payloads of the next `WRITE_BATCH_ROWS` rows (fewer at the end)."""
    return [_payload_bytes(row) for row in itertools.islice(rows, WRITE_BATCH_ROWS)]


def _payload_bytes(row: Any) -> bytes:
    payload = row["payload"]
    if payload is None:
        raise InvalidArgument("a row with a null payload")
    if isinstance(payload, str):
        return payload.encode()
    return bytes(payload)


class StreamEngineDataSource(DataSource):
    @classmethod
    def name(cls) -> str:
        return SOURCE_NAME

    def schema(self) -> str:
        return SCHEMA

    def reader(self, schema: StructType) -> StreamEngineBatchReader:
        reader = StreamEngineBatchReader(dict(self.options))
        self._forget_credentials()
        return reader

    def writer(self, schema: StructType, overwrite: bool) -> StreamEngineBatchWriter:
        writer = StreamEngineBatchWriter(dict(self.options), schema, overwrite)
        self._forget_credentials()
        return writer

    def streamWriter(self, schema: StructType, overwrite: bool) -> StreamEngineStreamWriter:
        if overwrite:
            raise InvalidArgument("the streamengine sink only appends: outputMode('append')")
        writer = StreamEngineStreamWriter(dict(self.options), schema)
        self._forget_credentials()
        return writer

    def streamReader(self, schema: StructType) -> StreamEngineStreamReader:
        reader = StreamEngineStreamReader(dict(self.options))
        self._forget_credentials()
        return reader

    def _forget_credentials(self) -> None:
        """PySpark pickles the data source with the read function it sends executors:
        the driver's token goes once the reader or writer (kept on the driver) holds it."""
        for name in DRIVER_CREDENTIAL_OPTIONS:
            self.options.pop(name, None)


def register(spark: Any) -> None:
    """Make `spark.read.format("streamengine")` available in this session."""
    spark.dataSource.register(StreamEngineDataSource)


__all__ = ["SCHEMA", "SOURCE_NAME", "StreamEngineDataSource", "register"]
