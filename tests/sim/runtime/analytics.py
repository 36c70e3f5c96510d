"""Spark jobs in the world on the runtime: the shipped data source (`client/spark.py`),
its driver's planning and its executors' reads and writes, unmodified, their blocking
calls taking turns with the loop (`blocking.BlockingThread`).

In a share of the seeds (`WorldConfig.analytics`, drawn from a generator of its own:
`random.Random(f"{seed}/analytics")`, its jobs from `f"{seed}/analytics-jobs"`), never
with the operator's trims and deletes nor replicas destroyed (a scan is then told
`Trimmed` or `DataLossError` by design), an analyst runs, every few hundred ms of the
safety phase, one of:

- a batch scan (`StreamEngineBatchReader`) of one of the world's streams, a few by
  name (`streams`) or a tenant's (`prefix`), planned on the driver, its reader and
  partitions pickled as Spark ships them to executors, each partition read as an
  executor reads it, in partitions of a drawn size; half of them bounded by
  `toSequence` at the end of the longest run of sealed segments every stream scanned
  starts with when the job begins, the others with `includeOpen`. Every row goes to
  its stream's checker as a bounded reader's (`Checker.follower_event`,
  `bounded_read_finished`): in order, each as written, none past the bound, and no
  acked event below that end missing;
- a micro-batch of a streaming query (`StreamEngineStreamReader`: `latestOffset`,
  `partitions`, `read`, `commit`) over one stream or a tenant's prefix, a few queries
  alive at once, each going on from the offset it reached: its rows to the checker as
  a follower's, and at each end offset every acked event below it read;
- what a tool beside Spark reads with the SDK: `StreamClient.read` or `read_batches` of
  one stream, to the end of its sealed segments (every acked event below it read) or to
  the acked end at call time, giving up sooner than the SDK's default once no replica
  can be read (`EXPORT_GIVE_UP_S`, so that a read can give up within the safety phase),
  or `subscribe_batches` for a while, each event to the checker as a reader's;
- a write job (`StreamEngineBatchWriter`, pickled as Spark ships it) appending rows to
  the analyst's own stream `a0/sink` (created through `SyncStreamClient`), a producer
  id per job; a job whose task failed (its leader lost, the master away) runs again as
  Spark retries a task, until it ends.

Once the world converged, each unfinished write job runs again until it ends, then a
scan with `includeOpen` of every stream must end within `FINAL_SCAN_MS`, holding every
acked event of the world's streams (liveness), and in the sink every row of every job
that ended, none twice, in its job's order (invariant 15), nothing else (`_check_sink`
says where a rebuild kept a sink's rows).
"""

from __future__ import annotations

import asyncio
import contextlib
import pickle
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import grpc
import pyarrow as pa
from pyspark.sql.types import BinaryType, StructField, StructType

from streamengine import StreamClient
from streamengine.client.errors import DataLossError, NotFound, StreamEngineError
from streamengine.client.spark import (
    StreamEngineBatchReader,
    StreamEngineBatchWriter,
    StreamEngineStreamReader,
)
from streamengine.client.sync import SyncStreamClient
from streamengine.master.core.model import SegmentState
from streamengine.protocol.framed import CallError
from streamengine.protocol.sequence import pack_sequence, unpack_sequence
from tests.sim.checkers import Violation
from tests.sim.runtime.blocking import BlockingThread

if TYPE_CHECKING:
    from tests.sim.runtime.world import World

T = TypeVar("T")

SINK_TENANT = "a0/"
SINK = f"{SINK_TENANT}sink"
# What a rebuild names a stream whose name never reached a store.
REBUILT_SINKS = f"{SINK_TENANT}stream-"
SINK_SCHEMA = StructType([StructField("payload", BinaryType(), nullable=False)])
# How often the analyst starts a job in the safety phase (uniform, ms).
JOB_EVERY_MS = (100, 700)
# Rows of a write job: one producer batch of the sink (`spark.WRITE_BATCH_ROWS` bounds it).
WRITE_ROWS = (1, 40)
# How long a batch tail (`subscribe_batches`) follows a stream (uniform, ms).
TAIL_MS = (200, 1500)
# Streaming queries alive at once.
QUERIES_MAX = 2
# Partition sizes a scan draws (`partitionEntries`): many small partitions cut segments.
PARTITION_ENTRIES = (3, 10, 50, 500_000)
# A tool's reads give up this soon (`give_up_after_s`, the least the SDK takes is above
# 4 s) once none of their replicas can be read: at the SDK's 10 s no read, begun in the
# safety phase, could give up before every node is back.
EXPORT_GIVE_UP_S = 5.0
# Once the world converged, the last scans and write jobs end within this much virtual
# time.
FINAL_SCAN_MS = 30_000
FINAL_RETRY_MS = 200
# Past every sequence: a scan's end that bounds nothing.
EVERYTHING = 1 << 64

# What a job's failure is, as Spark would see a task fail: retried, never a verdict.
JOB_FAILURES = (StreamEngineError, grpc.RpcError, CallError, TimeoutError)

Row = tuple[str, int, int, int, bytes]  # stream, epoch, index, sequence, payload


@dataclass
class _Query:
    """A streaming query: its reader (the driver's), its offset so far, its name as a
    follower of the streams it reads."""

    name: str
    reader: StreamEngineStreamReader
    streams: tuple[str, ...]
    offset: dict[str, Any] | None = None


@dataclass
class _WriteJob:
    producer_id: str
    payloads: list[bytes]
    runs: int = 0
    done: bool = False


@dataclass
class Analyst:
    """One world's Spark jobs (see the module doc)."""

    world: World
    rng: random.Random = field(init=False)
    jobs: int = 0
    queries: list[_Query] = field(default_factory=list)
    writes: list[_WriteJob] = field(default_factory=list)
    sink_created: bool = False

    def __post_init__(self) -> None:
        self.rng = random.Random(f"{self.world.config.seed}/analytics-jobs")

    # ---- the safety phase ----

    async def run(self) -> None:
        world = self.world
        actions: list[tuple[float, Callable[[], Any]]] = [
            (0.35, self._scan_some),
            (0.25, self._micro_batch),
            (0.2, self._write),
            (0.2, self._export),
        ]
        while world.phase == "safety":
            await asyncio.sleep(self.rng.randint(*JOB_EVERY_MS) / 1000)
            if world.phase != "safety" or world.violation is not None:
                return
            [action] = self.rng.choices([a for _, a in actions], [w for w, _ in actions])
            self.jobs += 1
            name = action.__name__.strip("_")
            try:
                try:
                    await action()
                except JOB_FAILURES as error:
                    world.note(f"spark job {self.jobs} ({name}): {type(error).__name__}: {error}")
                    world.count(f"spark {name} {_failure(error)}")
            except Violation as violation:
                world.check(_raise, violation)
                return

    async def _in_thread(self, job: str, function: Callable[..., T], *args: Any) -> T:
        """`function(*args)`: synchronous code, as Spark's driver or an executor runs it."""
        return await BlockingThread(f"{job}{self.jobs}").run(function, *args)

    def _options(self, **options: str) -> dict[str, str]:
        # PySpark hands a data source its options with lower-cased keys.
        given = {"master": self.world.masters.address, **options}
        return {key.lower(): value for key, value in given.items()}

    # ---- batch scans ----

    def _sealed_end(self, stream: str) -> int:
        """The sequence past the longest run of sealed segments `stream` starts with, in
        what the serving master holds (0: none, or no master serves)."""
        state = self.world.masters.state
        if state is None:
            return 0
        end = 0
        for segment in state.stream_segments(self.world.checkers[stream].stream_id):
            if segment.state != SegmentState.SEALED:
                break
            end = pack_sequence(segment.epoch, segment.final_index + 1)
        return end

    def _selection(self) -> tuple[dict[str, str], list[str]]:
        """Which of the world's streams a job reads: options and the streams they name."""
        names = self.world.stream_names
        roll = self.rng.random()
        if roll < 0.5:
            stream = self.rng.choice(names)
            return {"stream": stream}, [stream]
        if roll < 0.75:
            sample = sorted(self.rng.sample(names, self.rng.randint(1, min(4, len(names)))))
            return {"streams": ",".join(sample)}, sample
        tenant = self.rng.choice(sorted({name.split("/")[0] for name in names}))
        return {"prefix": f"{tenant}/"}, [n for n in names if n.startswith(f"{tenant}/")]

    async def _scan_some(self) -> None:
        options, streams = self._selection()
        end = min(self._sealed_end(stream) for stream in streams)
        bounded = self.rng.random() < 0.5
        if bounded:
            if end == 0:
                self.world.count("spark scan without a sealed segment")
                return
            options["toSequence"] = str(end)
        else:
            options["includeOpen"] = "true"
        options["partitionEntries"] = str(self.rng.choice(PARTITION_ENTRIES))
        reader = f"spark{self.jobs}"
        self.world.note(f"spark job {self.jobs}: scan {options}")
        rows = await self._in_thread("scan", _scan, self._options(**options))
        ends = dict.fromkeys(streams, end)
        self._rows_read(reader, rows, streams, ends, past_ends=not bounded)
        self.world.count("spark scans checked")

    def _rows_read(
        self,
        reader: str,
        rows: list[Row],
        streams: list[str],
        ends: dict[str, int],
        past_ends: bool = False,
    ) -> None:
        """`rows` as `reader` read them, to the checkers: each stream's rows in order,
        none at or past its end unless `past_ends`, and every acked event below its end
        read."""
        by_stream: dict[str, list[Row]] = {}
        for row in rows:
            if row[0] not in streams:
                raise Violation(1, f"{reader} read {row[0]}, which it never asked for")
            by_stream.setdefault(row[0], []).append(row)
        for stream, read in by_stream.items():
            checker = self.world.checkers[stream]
            for _, epoch, index, sequence, payload in read:
                if (epoch, index) != unpack_sequence(sequence):
                    raise Violation(1, f"{reader}: {stream} row {epoch}/{index} at {sequence}")
                if sequence >= ends[stream] and not past_ends:
                    raise Violation(1, f"{reader}: {stream} row {epoch}/{index} past its end")
                checker.follower_event(reader, sequence, payload)
        for stream in streams:
            self.world.checkers[stream].bounded_read_finished(reader, ends[stream])

    # ---- streaming queries ----

    async def _micro_batch(self) -> None:
        if len(self.queries) < QUERIES_MAX and (not self.queries or self.rng.random() < 0.3):
            options, streams = self._selection()
            if "streams" in options:  # a query reads one stream or a prefix
                options, streams = {"stream": streams[0]}, streams[:1]
            if self.rng.random() < 0.5:
                options["maxEventsPerTrigger"] = str(self.rng.randint(1, 20))
            name = f"query{self.jobs}"
            reader = StreamEngineStreamReader(self._options(**options))
            self.queries.append(_Query(name, reader, tuple(streams)))
        query = self.rng.choice(self.queries)
        offset, rows = await self._in_thread("batch", _micro_batch, query.reader, query.offset)
        ends = _ends(query, offset)
        self._rows_read(query.name, rows, list(query.streams), ends)
        query.offset = offset
        self.world.count("spark micro-batches checked")

    # ---- the SDK's bounded reads and batch tails ----

    async def _export(self) -> None:
        """What a tool beside Spark reads with the SDK: `read` or `read_batches` of one
        stream to the end of its sealed segments or to the acked end at call time
        (`end=None`), giving up after `EXPORT_GIVE_UP_S` without a replica to read (as
        Unavailable), or `subscribe_batches` for a while; every event to the checker."""
        stream = self.rng.choice(self.world.stream_names)
        checker = self.world.checkers[stream]
        reader = f"export{self.jobs}"
        end = self._sealed_end(stream)
        how = self.rng.choice(("read", "read_batches", "subscribe_batches"))
        bounded = how != "subscribe_batches" and end > 0 and self.rng.random() < 0.5
        self.world.note(
            f"spark job {self.jobs}: {how} {stream}" + (f" to {end}" if bounded else "")
        )
        rows: list[tuple[int, bytes]] = []
        async with StreamClient(self.world.masters.address) as client:
            if how == "read":
                read = client.read(
                    stream, 0, end if bounded else None, give_up_after_s=EXPORT_GIVE_UP_S
                )
                async for event in read:
                    rows.append((event.sequence, event.payload))
            elif how == "read_batches":
                batches = client.read_batches(
                    stream, 0, end if bounded else None, give_up_after_s=EXPORT_GIVE_UP_S
                )
                async for batch in batches:
                    rows += _sequenced(batch)
            else:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.rng.randint(*TAIL_MS) / 1000):
                        async for batch in client.subscribe_batches(stream, 0):
                            rows += _sequenced(batch)
        for sequence, payload in rows:
            if bounded and sequence >= end:
                raise Violation(1, f"{reader}: {stream} read {sequence} past its end {end}")
            checker.follower_event(reader, sequence, payload)
        if bounded:
            checker.bounded_read_finished(reader, end)
        self.world.count(f"spark {how} checked")

    # ---- writes to the sink ----

    async def _write(self) -> None:
        unfinished = [job for job in self.writes if not job.done]
        if unfinished:
            job = unfinished[0]
        else:
            n = len(self.writes) + 1
            rows = self.rng.randint(*WRITE_ROWS)
            job = _WriteJob(f"job{n}", [f"a:{n}:{row}".encode() for row in range(rows)])
            self.writes.append(job)
        await self._run_write(job)

    async def _sink_written(self, job: str, function: Callable[..., T], *args: Any) -> T:
        """`function(*args)` writing the sink, which is created first where it is not.
        A master rebuilt from the stores may not know it (created less than a heartbeat
        before the metadata was lost, it comes back nameless at best): it is created
        again, as its owner would."""
        if not self.sink_created:
            policy = self.world.config.policy
            address = self.world.masters.address
            replicas, quorum = policy.replicas, policy.write_quorum
            await self._in_thread("create", _create_sink, address, replicas, quorum)
            self.world.note(f"spark: {SINK} created")
            self.sink_created = True
        try:
            return await self._in_thread(job, function, *args)
        except NotFound:
            self.sink_created = False
            raise

    async def _run_write(self, job: _WriteJob) -> None:
        job.runs += 1
        options = self._options(stream=SINK, producerId=job.producer_id)
        rows = await self._sink_written("write", _write_rows, options, job.payloads)
        if rows != len(job.payloads):
            raise Violation(15, f"write {job.producer_id}: {rows} rows of {len(job.payloads)}")
        job.done = True
        self.world.note(f"spark {job.producer_id}: {rows} rows written in {job.runs} runs")
        self.world.count("spark writes done")

    # ---- once the world converged ----

    async def final(self) -> None:
        """The last write jobs and scans, each retried until it ends (module doc)."""
        async with asyncio.timeout(FINAL_SCAN_MS / 1000):
            for job in self.writes:
                while not job.done:
                    await self._retried(lambda job=job: self._run_write(job))  # type: ignore[misc]
            for stream in self.world.stream_names:
                if stream not in self.world.removed:
                    await self._retried(lambda stream=stream: self._scan_all(stream))  # type: ignore[misc]
            if self.sink_created:
                await self._retried(self._check_sink)
                await self._retried(self._lead_sink)
                await self._retried(self._check_sink)

    async def _lead_sink(self) -> None:
        """Lead the sink once more and append a marker through the SDK's synchronous
        writer, once the sink was found whole without it: a write task whose writer
        closed while no store could be told its acked index hands it to the master,
        which tells the stores (seed 227)."""
        marker = _WriteJob("marker", [f"a:marker:{len(self.writes)}".encode()])
        self.writes.append(marker)
        address = self.world.masters.address
        await self._sink_written("mark", _append_marker, address, marker.payloads[0])
        marker.done = True

    async def _retried(self, job: Callable[[], Any]) -> None:
        while True:
            try:
                await job()
                return
            except JOB_FAILURES as error:
                self.world.note(f"spark, once converged: {type(error).__name__}: {error}")
                self.world.count(f"spark final {_failure(error)}")
            await asyncio.sleep(FINAL_RETRY_MS / 1000)

    async def _scan_all(self, stream: str) -> None:
        self.jobs += 1
        options = self._options(stream=stream, includeOpen="true")
        rows = await self._in_thread("final", _scan, options)
        ends = {stream: EVERYTHING}
        self._rows_read(f"spark{self.jobs}", rows, [stream], ends)

    async def _check_sink(self) -> None:
        """Every row every job wrote, in its job's order, none twice in one stream and
        nothing else, in the sink or in a stream a rebuild kept for it: a sink created
        less than a heartbeat before the master's metadata was lost is rebuilt as
        `a0/stream-<id>` (docs/design.md, "Rebuild"), and the next job creates the sink
        again (its rows twice across the two, where its answer was lost)."""
        options = self._options(prefix=SINK_TENANT, includeOpen="true")
        rows = await self._in_thread("sink", _scan, options)
        address = self.world.masters.address
        listed = await self._in_thread("list", _sinks_listed, address)
        by_stream: dict[str, list[bytes]] = {}
        for row in rows:
            by_stream.setdefault(row[0], []).append(row[4])
        if any(not name.startswith((SINK, REBUILT_SINKS)) for name in listed):
            raise Violation(15, f"the sink's tenant holds {listed}")
        if not set(by_stream) <= set(listed):
            raise Violation(16, f"rows of {sorted(by_stream)}, yet the master lists {listed}")
        written = {payload: job for job in self.writes for payload in job.payloads}
        for stream, read in sorted(by_stream.items()):
            if len(set(read)) != len(read):
                again = next(p for p in read if read.count(p) > 1)
                raise Violation(15, f"{stream} holds {again!r} twice")
            strangers = [p for p in read if p not in written]
            if strangers:
                raise Violation(15, f"{stream} holds {strangers[0]!r}, which no job wrote")
            for job in self.writes:
                order = [p for p in read if written[p] is job]
                if order != sorted(order, key=job.payloads.index):
                    raise Violation(15, f"{job.producer_id}'s rows out of order in {stream}")
        found = {p for read in by_stream.values() for p in read}
        missing = [p for job in self.writes if job.done for p in job.payloads if p not in found]
        if missing:
            raise Violation(1, f"the sink lacks {len(missing)} rows written, {missing[0]!r} first")
        self.world.count("spark sink rows checked", len(found))


def _raise(violation: Violation) -> None:
    raise violation


def _failure(error: BaseException) -> str:
    if isinstance(error, grpc.RpcError):
        return error.code().name
    if isinstance(error, CallError):
        return error.code.name
    if isinstance(error, DataLossError) and not error.accepted:
        # Every store syncs what it answers: a scan told a loss nobody declared.
        raise Violation(1, f"a Spark read told a loss no operator declared: {error}")
    return type(error).__name__


def _ends(query: _Query, offset: dict[str, Any]) -> dict[str, int]:
    if "sequence" in offset:
        return {query.streams[0]: int(offset["sequence"])}
    sequences = offset["sequences"]
    return {stream: int(sequences.get(stream, 0)) for stream in query.streams}


# ---- synchronous: Spark's driver and executors ----


def _sequenced(batch: pa.RecordBatch) -> list[tuple[int, bytes]]:
    """(sequence, payload) of each row of an SDK record batch (`packed.EVENT_SCHEMA`)."""
    columns = batch.to_pydict()
    return list(zip(columns["sequence"], columns["payload"], strict=True))


def _rows(batch: pa.RecordBatch) -> list[Row]:
    columns = batch.to_pydict()
    return list(
        zip(
            columns["stream"],
            columns["epoch"],
            columns["index"],
            columns["sequence"],
            columns["payload"],
            strict=True,
        )
    )


def _executed(reader: Any, partitions: list[Any]) -> list[Row]:
    """Each partition read as an executor reads it: the reader and the partition
    pickled, as Spark ships them."""
    executor = pickle.loads(pickle.dumps(reader))
    rows: list[Row] = []
    for partition in partitions:
        for batch in executor.read(pickle.loads(pickle.dumps(partition))):
            rows += _rows(batch)
    return rows


def _scan(options: dict[str, str]) -> list[Row]:
    reader = StreamEngineBatchReader(options)
    return _executed(reader, reader.partitions())


def _micro_batch(
    reader: StreamEngineStreamReader, start: dict[str, Any] | None
) -> tuple[dict[str, Any], list[Row]]:
    begin = reader.initialOffset() if start is None else start
    end = reader.latestOffset(begin, None)
    rows = _executed(reader, reader.partitions(begin, end))
    reader.commit(end)
    return end, rows


def _create_sink(master: str, replicas: int, write_quorum: int) -> None:
    with SyncStreamClient(master) as client:
        client.create_stream(SINK, replicas=replicas, write_quorum=write_quorum)


def _append_marker(master: str, payload: bytes) -> None:
    """`payload` appended to the sink through the SDK's synchronous writer."""
    with SyncStreamClient(master) as client, client.writer(SINK) as writer:
        writer.append(payload)
        writer.flush()


def _sinks_listed(master: str) -> list[str]:
    """The streams of the sink's tenant, as `streamengine stream list --tenant` lists
    them through the SDK's synchronous client, a page of two at a time."""
    with SyncStreamClient(master) as client:
        tenant = SINK_TENANT.rstrip("/")
        return [info.name for info in client.list_streams(tenant=tenant, page_size=2)]


def _write_rows(options: dict[str, str], payloads: list[bytes]) -> int:
    driver = StreamEngineBatchWriter(options, SINK_SCHEMA, overwrite=False)
    task = pickle.loads(pickle.dumps(driver))
    written = task.write(iter([{"payload": payload} for payload in payloads]))
    return int(written.rows)
