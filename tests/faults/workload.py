"""Writer and reader processes on the real SDK, each recording its own history.

    python -m tests.faults.workload writer --master A --streams t/a,t/b --name w1 --inc 2 \
        --history DIR --seed 7 [--rate 300] [--batch-max 20] [--size-max 4096]
    python -m tests.faults.workload reader --master A --streams t/a,t/b --name r1 --inc 1 \
        --history DIR --seed 7 [--churn-s 5] [--consume-ms 2] [--multiplexed]

`--dial ADVERTISED=ADDRESS` (repeatable) makes the process reach a server through
another address, e.g. a store through the harness's fault proxy (`tests.faults.proxy`).

A writer contends for leadership of every stream (one `StreamClient.writer` session at a
time per stream), appends pipelined batches and records invoke / ok / fail / info; when
a session ends (leadership lost, a background failure) it opens a new one. A reader
subscribes to every stream from its last recorded token (so a restarted reader resumes
exactly after what it recorded), records every delivery, and now and then drops its
subscription and resumes: a client and a `subscribe` per stream, or with
`--multiplexed` one client and one `subscribe_many` carrying every stream. SIGTERM:
stop invoking, let pending appends finish (bounded), exit 0. Both stop by themselves
after `--max-s`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import random
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from streamengine.client import StreamClient, StreamEvent
from streamengine.client.errors import (
    AppendFailed,
    DataLossError,
    InvalidArgument,
    NotFound,
    StreamEngineError,
)
from streamengine.protocol import logs
from streamengine.protocol.sequence import pack_sequence
from tests.faults import payload
from tests.faults.channels import stream_client
from tests.faults.history import Recorder, read_file

# Errors the SDK documents as "not written": the append can never appear.
DEFINITE_ERRORS: tuple[type[BaseException], ...] = (AppendFailed, InvalidArgument, NotFound)
# Appends in flight per writer session (pipelining).
PIPELINE_DEPTH = 4
# After SIGTERM, pending appends get this long to finish.
DRAIN_S = 10.0
# Between writer sessions (leadership lost, or not granted).
SESSION_PAUSE_S = 0.2
LEADERSHIP_WAIT_S = 30.0
# Reader deliveries are recorded at least this often, and in lines of at most this many.
DELIVER_FLUSH_S = 0.05
DELIVER_FLUSH_EVENTS = 128
# A slow consumer (`--consume-ms`) pauses once per this many events.
SLOW_CONSUMER_STEP = 64
# A client whose first call to the master failed is started again after this long.
CLIENT_RETRY_S = 0.5
# A subscription that failed otherwise than by a loss is started again after this long.
SUBSCRIBE_RETRY_S = 0.5


def classify(error: BaseException) -> str:
    return "fail" if isinstance(error, DEFINITE_ERRORS) else "info"


def describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"[:300]



def connect(args: argparse.Namespace) -> StreamClient:
    """A client of the run's cluster: through the proxy's links when `--dial` says so,
    over TLS as the cluster's admin when the run exports its certs dir."""
    return stream_client(args.master, args.dial)


@contextlib.asynccontextmanager
async def connected(
    args: argparse.Namespace,
    recorder: Recorder,
    stopping: asyncio.Event,
    connect_client: Callable[[argparse.Namespace], StreamClient] = connect,
) -> AsyncIterator[StreamClient]:
    """A started client (`connect`). A start that fails (its first call to the master)
    is recorded (`client_error`) and tried again, as an application would, until it
    succeeds or the process stops: a workload process never dies of it."""
    while True:
        client = connect_client(args)
        try:
            await client.__aenter__()
            break
        except StreamEngineError as error:
            recorder.record("client_error", error=describe(error))
            if stopping.is_set():
                raise
            await asyncio.sleep(CLIENT_RETRY_S)
    try:
        yield client
    finally:
        await client.close()

class WriterWorkload:
    def __init__(self, args: argparse.Namespace, recorder: Recorder) -> None:
        self.args = args
        self.recorder = recorder
        self.rng = random.Random(f"{args.seed}/{args.name}/{args.inc}")
        self.writer_id = f"{args.name}.{args.inc}"
        self.stopping = asyncio.Event()
        self.next_op = 0
        self.sessions = 0

    async def run(self) -> None:
        async with connected(self.args, self.recorder, self.stopping) as client, \
                asyncio.TaskGroup() as group:
            for stream in self.args.streams.split(","):
                group.create_task(self.stream_loop(client, stream))

    async def stream_loop(self, client: StreamClient, stream: str) -> None:
        while not self.stopping.is_set():
            self.sessions += 1
            session = f"{self.writer_id}-{self.sessions}"
            try:
                await self.session(client, stream, session)
            except* StreamEngineError as group:
                self.recorder.record("session_end", stream=stream, session=session,
                                     error=describe(group.exceptions[0]))
            except* Exception as group:  # a background loop's failure, or grpc's
                self.recorder.record("session_end", stream=stream, session=session,
                                     error=describe(group.exceptions[0]))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stopping.wait(), SESSION_PAUSE_S)

    async def session(self, client: StreamClient, stream: str, session: str) -> None:
        # Waiting for leadership ends early on SIGTERM.
        waiter = asyncio.ensure_future(self.stopping.wait())
        opening = asyncio.ensure_future(
            client.writer(
                stream, client_id=session, leadership_timeout_s=LEADERSHIP_WAIT_S
            ).__aenter__()
        )
        done, _ = await asyncio.wait({waiter, opening}, return_when=asyncio.FIRST_COMPLETED)
        if opening not in done:
            opening.cancel()
            with contextlib.suppress(BaseException):
                await opening
            return
        waiter.cancel()
        writer = opening.result()
        try:
            await self.appends(writer, stream, session)
        finally:
            await writer.__aexit__(None, None, None)

    async def appends(self, writer: object, stream: str, session: str) -> None:
        from streamengine.client.writer import Writer

        assert isinstance(writer, Writer)
        epoch = writer.epoch
        self.recorder.record("grant", stream=stream, epoch=epoch, client=session)
        slots = asyncio.Semaphore(PIPELINE_DEPTH)
        pending: set[asyncio.Task[None]] = set()
        lost = asyncio.Event()
        interval_s = 1.0 / self.args.rate if self.args.rate else 0.0
        next_at = time.monotonic()
        while not self.stopping.is_set() and not lost.is_set() and writer.leading:
            await slots.acquire()
            if self.stopping.is_set() or lost.is_set() or not writer.leading:
                slots.release()
                break
            count = self.rng.randint(1, self.args.batch_max)
            op = self.next_op
            self.next_op += 1
            ids = [payload.payload_id(self.writer_id, op, k) for k in range(count)]
            values = [
                payload.make(self.writer_id, op, k, self.size(), self.rng) for k in range(count)
            ]
            self.recorder.record("invoke", stream=stream, op=op, ids=ids, session=session)
            # The call starts here, in invocation order: sequences follow it.
            call = asyncio.ensure_future(writer.append_batch(values))
            task = asyncio.ensure_future(self.complete(call, stream, op, slots, lost))
            pending.add(task)
            task.add_done_callback(pending.discard)
            if writer.epoch != epoch:
                epoch = writer.epoch
                self.recorder.record("grant", stream=stream, epoch=epoch, client=session)
            next_at += interval_s * count
            delay = next_at - time.monotonic()
            if delay > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.stopping.wait(), delay)
            else:
                next_at = time.monotonic()
        if pending:
            await asyncio.wait(pending, timeout=DRAIN_S)
        for task in pending:
            task.cancel()

    async def complete(
        self,
        call: asyncio.Future[list[int]],
        stream: str,
        op: int,
        slots: asyncio.Semaphore,
        lost: asyncio.Event,
    ) -> None:
        try:
            sequences = await call
        except asyncio.CancelledError:
            self.recorder.record("info", stream=stream, op=op, error="cancelled at exit")
            raise
        except Exception as error:
            self.recorder.record(classify(error), stream=stream, op=op, error=describe(error))
            lost.set()
        else:
            self.recorder.record("ok", stream=stream, op=op, seqs=sequences)
        finally:
            slots.release()

    def size(self) -> int:
        # Mostly small events, now and then a large one.
        if self.rng.random() < 0.02:
            return self.rng.randint(self.args.size_max // 2, self.args.size_max)
        return self.rng.randint(64, 512)


class Deliveries:
    """What a subscription hands out, recorded as `deliver` lines per stream: at least
    every `DELIVER_FLUSH_S`, in lines of at most `DELIVER_FLUSH_EVENTS`; each event moves
    its stream's token (the last sequence recorded)."""

    def __init__(self, recorder: Recorder, tokens: dict[str, int]) -> None:
        self.recorder = recorder
        self.tokens = tokens
        self.buffers: dict[str, list[list[object]]] = {}
        self.flushed_at = time.monotonic()

    def add(self, stream: str, event: StreamEvent) -> None:
        parsed = payload.parse(event.payload)
        buffer = self.buffers.setdefault(stream, [])
        buffer.append([event.sequence, event.epoch, event.index, parsed.pid,
                       payload.fingerprint(event.payload), parsed.intact])
        self.tokens[stream] = event.sequence
        if len(buffer) >= DELIVER_FLUSH_EVENTS:
            self.flush_stream(stream)
        if time.monotonic() - self.flushed_at > DELIVER_FLUSH_S:
            self.flush()

    def flush_stream(self, stream: str) -> None:
        buffer = self.buffers.pop(stream, None)
        if buffer:
            self.recorder.record("deliver", stream=stream, events=buffer)

    def flush(self) -> None:
        for stream in list(self.buffers):
            self.flush_stream(stream)
        self.flushed_at = time.monotonic()

    async def flush_when_idle(self) -> None:
        """The last events before a quiet spell are recorded too, not only once the next
        event comes (the catch-up figure reads the history)."""
        while True:
            await asyncio.sleep(DELIVER_FLUSH_S)
            if time.monotonic() - self.flushed_at > DELIVER_FLUSH_S:
                self.flush()


class ReaderWorkload:
    """Follows its streams, each with its own client and `subscribe` (the per-stream
    path), or all through one client and one `subscribe_many` (`--multiplexed`, as an
    application following many streams would). Both record the same history."""

    def __init__(
        self,
        args: argparse.Namespace,
        recorder: Recorder,
        history: Path,
        connect_client: Callable[[argparse.Namespace], StreamClient] = connect,
    ) -> None:
        self.args = args
        self.recorder = recorder
        self.connect_client = connect_client
        self.rng = random.Random(f"{args.seed}/{args.name}/{args.inc}")
        self.stopping = asyncio.Event()
        self.tokens = last_tokens(history)
        # A range reported lost, which the next subscription goes past.
        self.accepted_loss: dict[str, list[int]] = {}

    async def run(self) -> None:
        streams = self.args.streams.split(",")
        if self.args.multiplexed:
            await self.follow_many(streams)
            return
        async with asyncio.TaskGroup() as group:
            for stream in streams:
                group.create_task(self.stream_loop(stream))

    async def stream_loop(self, stream: str) -> None:
        while not self.stopping.is_set():
            async with self.connected() as client:
                # A few subscriptions per client, then a fresh client.
                for _ in range(self.rng.randint(1, 4)):
                    if self.stopping.is_set():
                        return
                    await self.subscription(client, stream)

    async def follow_many(self, streams: list[str]) -> None:
        """One client for the process's life, one subscription of every stream at a
        time, dropped now and then and resumed from the tokens."""
        async with self.connected() as client:
            while not self.stopping.is_set():
                await self.subscription_many(client, streams)

    def connected(self) -> contextlib.AbstractAsyncContextManager[StreamClient]:
        return connected(self.args, self.recorder, self.stopping, self.connect_client)

    def resume_from(self, stream: str) -> int:
        """Where `stream` is read from next (just after its token, or 0), recorded."""
        token = self.tokens.get(stream)
        start = 0 if token is None else token + 1
        skipping = self.accepted_loss.pop(stream, None)
        self.recorder.record("subscribe", stream=stream, **{"from": start},
                             **({"after_loss": skipping} if skipping else {}))
        return start

    def churn_at(self) -> float:
        """When the subscription starting now is dropped (the loop's clock)."""
        life_s = self.rng.uniform(0.3, 2.0) * self.args.churn_s
        return asyncio.get_running_loop().time() + life_s

    async def consume(self, consumed: int) -> None:
        if self.args.consume_ms and consumed % SLOW_CONSUMER_STEP == 0:
            # A slow consumer: the time its work on these events took.
            await asyncio.sleep(SLOW_CONSUMER_STEP * self.args.consume_ms / 1000)

    def on_loss(self, error: DataLossError) -> None:
        """The reader accepts the loss, explicitly: it goes on just past the range. At
        once, as an application would: the range is known, nothing to wait for."""
        lost = [error.segment_epoch, error.first_index, error.last_index]
        self.recorder.record("error", stream=error.stream, error=describe(error),
                             data_loss=lost)
        self.tokens[error.stream] = pack_sequence(error.segment_epoch, error.last_index + 1) - 1
        self.accepted_loss[error.stream] = lost

    async def subscription(self, client: StreamClient, stream: str) -> None:
        events = client.subscribe(stream, start=self.resume_from(stream))
        await self.follow(events, [stream])

    async def subscription_many(self, client: StreamClient, streams: list[str]) -> None:
        """One `subscribe_many` of every stream, each from its own position. A stream's
        loss (or trim) ends the whole subscription, naming the stream: that stream goes
        on past the loss and every other from its token, in the next one."""
        positions = {stream: self.resume_from(stream) for stream in streams}
        await self.follow(client.subscribe_many(streams, positions=positions), streams)

    async def follow(self, events: AsyncIterator[StreamEvent], streams: list[str]) -> None:
        """Record what `events` delivers of `streams` until the churn drops it."""
        deliveries = Deliveries(self.recorder, self.tokens)
        consumed = 0
        flusher = asyncio.ensure_future(deliveries.flush_when_idle())
        try:
            async with asyncio.timeout_at(self.churn_at()):
                async for event in events:
                    deliveries.add(event.stream or streams[0], event)
                    if self.stopping.is_set():
                        break
                    consumed += 1
                    await self.consume(consumed)
        except TimeoutError:
            pass  # churn: drop the subscription, resume every stream from its token
        except DataLossError as error:
            deliveries.flush()
            self.on_loss(error)
        except Exception as error:
            deliveries.flush()
            # An error that names its stream (`Trimmed`) ended that stream's reading;
            # one that names none (the master unreachable at the start) ended every one.
            named = getattr(error, "stream", None)
            for stream in [named] if named in streams else streams:
                self.recorder.record("error", stream=stream, error=describe(error))
            await asyncio.sleep(SUBSCRIBE_RETRY_S)
        finally:
            flusher.cancel()
            deliveries.flush()
            with contextlib.suppress(Exception):
                await events.aclose()  # type: ignore[attr-defined]


def last_tokens(history: Path) -> dict[str, int]:
    """The last sequence this reader recorded per stream (an earlier incarnation's)."""
    tokens: dict[str, int] = {}
    if history.exists():
        for record in read_file(history):
            if record["type"] == "deliver" and record["events"]:
                tokens[record["stream"]] = int(record["events"][-1][0])
    return tokens


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tests.faults.workload")
    parser.add_argument("role", choices=["writer", "reader"])
    parser.add_argument("--master", required=True)
    parser.add_argument("--streams", required=True, help="comma-separated stream names")
    parser.add_argument("--name", required=True, help="process name (w1, r2, ...)")
    parser.add_argument("--inc", type=int, default=1, help="incarnation of this process")
    parser.add_argument("--history", type=Path, required=True, help="history directory")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rate", type=float, default=300.0, help="events/s per stream")
    parser.add_argument("--batch-max", type=int, default=20)
    parser.add_argument("--size-max", type=int, default=16384)
    parser.add_argument("--churn-s", type=float, default=5.0, help="mean subscription life")
    parser.add_argument("--consume-ms", type=float, default=0.0,
                        help="a reader's work per event (a slow consumer)")
    parser.add_argument("--multiplexed", action="store_true",
                        help="a reader follows every stream through one subscribe_many")
    parser.add_argument("--max-s", type=float, default=900.0, help="exit after this long")
    parser.add_argument("--dial", action="append", default=[], metavar="ADVERTISED=ADDRESS",
                        help="reach the server advertised at ADVERTISED at ADDRESS instead")
    args = parser.parse_args(argv)
    args.dial = dict(item.split("=", 1) for item in args.dial)
    return args


async def main_async(args: argparse.Namespace) -> int:
    path = args.history / f"{args.name}.jsonl"
    # Tokens come from what earlier incarnations recorded, before this one writes.
    workload: WriterWorkload | ReaderWorkload
    recorder = Recorder(path, args.name, inc=args.inc)
    if args.role == "writer":
        # The SDK's own account (sessions lost and dialled, rolls, seals) lands in the
        # process's log beside the history: a missed bound is traced from it.
        logs.configure(logging.INFO)
        workload = WriterWorkload(args, recorder)
    else:
        workload = ReaderWorkload(args, recorder, path)
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, workload.stopping.set)
    loop.call_later(args.max_s, workload.stopping.set)
    recorder.record("start", role=args.role, pid=_pid(), consume_ms=args.consume_ms,
                    streams=args.streams.split(","))
    runner = asyncio.ensure_future(workload.run())
    await workload.stopping.wait()
    if args.role == "reader":
        runner.cancel()  # a reader has nothing pending: its deliveries are flushed
    try:
        await asyncio.wait_for(asyncio.shield(runner), DRAIN_S + 5)
    except (TimeoutError, asyncio.CancelledError):  # too slow, or a reader cancelled
        runner.cancel()
        with contextlib.suppress(BaseException):
            await runner
    recorder.record("stop")
    recorder.close()
    return 0


def _pid() -> int:
    import os

    return os.getpid()


def main() -> int:
    return asyncio.run(main_async(parse_args(sys.argv[1:])))


if __name__ == "__main__":
    sys.exit(main())
