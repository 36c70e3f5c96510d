"""The store side of one Subscribe stream (a live tail), as a pure state machine.

Theory of operation (docs/design.md, "Readers"; the line protocol of
`seeds/001_de056e7625535a7e.txt` carried over gRPC streaming):

- the stream opens with a POSITION: the segment's acked index, fence and bridge;
- entries at or below the acked index follow in batches of at most `batch_entries`,
  each carrying its token (its last index), as the acked index advances;
- when the segment's position changes while no entries flow (sealed, a bridge), a new
  POSITION says so;
- when nothing was sent for one keepalive interval, a keepalive goes out;
- a subscriber silent for `SILENT_INTERVALS_MAX` intervals is dropped ("silent");
- a subscriber whose buffer of `buffer_messages` stays full for `stall_ms` is
  disconnected ("slow"): it resumes from its last token on a new stream.

A multiplexed call (many segments' tails on one call) splits the same rules: each
segment's `SegmentTail` decides its positions and batches, the call's `CallLiveness`
its silence, stall and keepalives (one per call, not per segment: an idle call of
10,000 tails sends one keepalive an interval). A call of one segment is `TailStream`,
both together.

`TailStream.step(position, buffered, now_ms)` answers the one thing to do next; the
shell (`streamengine.segment_store.tail`, the simulator's store node) carries it out: it
reads the entries a `ReadBatch` asks for and reports them with `on_read`, queues what
it sends, reports what the subscriber sends with `on_heard`, and waits for a change of
the segment, room in the buffer, or `WaitUntil.until_ms`. No I/O, no clock.
"""

from __future__ import annotations

from dataclasses import dataclass

# Entries per batch when the subscriber does not say, and the keepalive interval it may
# ask for: bounded so that a subscriber cannot make the store spin or go quiet for long.
BATCH_ENTRIES_DEFAULT = 256
KEEPALIVE_MS_DEFAULT = 1000
KEEPALIVE_MS_MIN = 50
KEEPALIVE_MS_MAX = 60_000
# A subscriber silent this many keepalive intervals is gone.
SILENT_INTERVALS_MAX = 3
# The subscriber's buffer, in messages waiting for the wire, and how long it may stay
# full before the subscriber counts as too slow.
BUFFER_MESSAGES_DEFAULT = 16
STALL_MS_DEFAULT = 5000

# Tails one multiplexed call may run at once: a reader following every stream of a
# large tenant (10,000 streams is the design's figure) through one call per store, with
# room to spare; each costs the store a few hundred bytes and nothing while idle.
MULTIPLEXED_TAILS_MAX = 65_536

assert KEEPALIVE_MS_MIN <= KEEPALIVE_MS_DEFAULT <= KEEPALIVE_MS_MAX
assert SILENT_INTERVALS_MAX >= 2, "one late keepalive must not drop a subscriber"


@dataclass(frozen=True, slots=True)
class TailSettings:
    batch_entries: int = BATCH_ENTRIES_DEFAULT
    keepalive_ms: int = KEEPALIVE_MS_DEFAULT
    buffer_messages: int = BUFFER_MESSAGES_DEFAULT
    stall_ms: int = STALL_MS_DEFAULT

    def __post_init__(self) -> None:
        assert self.batch_entries > 0 and self.buffer_messages > 0 and self.stall_ms > 0
        assert KEEPALIVE_MS_MIN <= self.keepalive_ms <= KEEPALIVE_MS_MAX

    @staticmethod
    def asked(
        batch_entries: int,
        keepalive_ms: int,
        entries_max: int,
        buffer_messages: int = BUFFER_MESSAGES_DEFAULT,
        stall_ms: int = STALL_MS_DEFAULT,
    ) -> TailSettings:
        """What a subscriber asked for (0: the default), bounded."""
        keepalive = keepalive_ms or KEEPALIVE_MS_DEFAULT
        return TailSettings(
            batch_entries=min(batch_entries or BATCH_ENTRIES_DEFAULT, entries_max),
            keepalive_ms=min(max(keepalive, KEEPALIVE_MS_MIN), KEEPALIVE_MS_MAX),
            buffer_messages=buffer_messages,
            stall_ms=stall_ms,
        )

    @property
    def silent_ms_max(self) -> int:
        return SILENT_INTERVALS_MAX * self.keepalive_ms


@dataclass(frozen=True, slots=True)
class Position:
    """What the store says of the segment: its acked index, fence and bridge (0: none)."""

    acked_index: int
    fence: int
    bridge_index: int


@dataclass(frozen=True, slots=True)
class SendPosition:
    position: Position


@dataclass(frozen=True, slots=True)
class ReadBatch:
    """Read acked entries `from_index..to_index`, at most `entries_max`, and send them
    as one batch; then `on_read`."""

    from_index: int
    to_index: int
    entries_max: int


@dataclass(frozen=True, slots=True)
class SendKeepalive:
    pass


@dataclass(frozen=True, slots=True)
class Drop:
    """End the stream: `reason` is "silent" or "slow"; `detail` says why to the peer."""

    reason: str
    detail: str


@dataclass(frozen=True, slots=True)
class WaitUntil:
    """Nothing to do until the segment changes, the buffer has room, or `until_ms`."""

    until_ms: int


Action = SendPosition | ReadBatch | SendKeepalive | Drop | WaitUntil


class TailStream:
    """A call that tails one segment: its `SegmentTail` and its `CallLiveness`."""

    def __init__(self, from_index: int, settings: TailSettings, now_ms: int) -> None:
        self.settings = settings
        self.segment = SegmentTail(from_index, settings.batch_entries)
        self.liveness = CallLiveness(settings, now_ms)

    @property
    def next_index(self) -> int:
        return self.segment.next_index

    # ---- inputs ----

    def on_heard(self, now_ms: int) -> None:
        """The subscriber sent something (a keepalive)."""
        self.liveness.on_heard(now_ms)

    def on_read(self, read: ReadBatch, last_index: int, now_ms: int) -> None:
        """The entries `read.from_index..last_index` went into the buffer as one batch
        (`last_index < read.from_index`: none could be read)."""
        if self.segment.on_read(read, last_index):
            self.liveness.on_sent(now_ms)

    # ---- decisions ----

    def step(self, position: Position, buffered: int, now_ms: int) -> Action:
        """The next thing to do, given the segment's position now and how many messages
        wait in the subscriber's buffer."""
        blocked = self.liveness.check(buffered, now_ms)
        if blocked is not None:
            return blocked
        action = self.segment.step(position)
        if action is not None:
            if isinstance(action, SendPosition):
                self.liveness.on_sent(now_ms)
            return action
        return self.liveness.idle(now_ms)


class SegmentTail:
    """What one segment's tail sends: its POSITION when it changes while caught up, and
    batches of the acked entries past what it sent. The call it rides on decides the
    rest (`CallLiveness`): a multiplexed call carries many of these."""

    def __init__(self, from_index: int, batch_entries: int) -> None:
        assert batch_entries > 0
        self.batch_entries = batch_entries
        self.next_index = max(from_index, 1)
        self._sent_position: Position | None = None

    def on_read(self, read: ReadBatch, last_index: int) -> bool:
        """The entries `read.from_index..last_index` went out as one batch; whether any
        did (`last_index < read.from_index`: none could be read)."""
        assert read.from_index == self.next_index, "reads are carried out in order"
        assert self._sent_position is not None
        assert last_index <= read.to_index
        if last_index < read.from_index:
            # Nothing served below the acked index it read: move on past it (the shell
            # read the acked index first, so this is only a race with a delete).
            self.next_index = read.to_index + 1
            return False
        self.next_index = last_index + 1
        sent = self._sent_position
        self._sent_position = Position(last_index, sent.fence, sent.bridge_index)
        return True

    def step(self, position: Position) -> SendPosition | ReadBatch | None:
        """What to send given the segment's position now; None: nothing until it changes."""
        if self._sent_position is None or (
            position != self._sent_position and self.next_index > position.acked_index
        ):
            self._sent_position = position
            return SendPosition(position)
        if self.next_index <= position.acked_index:
            return ReadBatch(self.next_index, position.acked_index, self.batch_entries)
        return None


class CallLiveness:
    """The rules of a Subscribe call as a whole: the subscriber's silence, its buffer
    staying full (too slow), and keepalives when nothing else was sent."""

    def __init__(self, settings: TailSettings, now_ms: int) -> None:
        self.settings = settings
        self._last_sent_ms = now_ms
        self._last_heard_ms = now_ms
        self._full_since_ms: int | None = None

    def on_heard(self, now_ms: int) -> None:
        """The subscriber sent something (a keepalive, a start, a stop)."""
        self._last_heard_ms = max(self._last_heard_ms, now_ms)

    def on_sent(self, now_ms: int) -> None:
        """Something other than a keepalive went into the buffer."""
        self._last_sent_ms = max(self._last_sent_ms, now_ms)

    def check(self, buffered: int, now_ms: int) -> Drop | WaitUntil | None:
        """Drop the call, or wait for room in its buffer; None: go on."""
        settings = self.settings
        silent_ms = now_ms - self._last_heard_ms
        if silent_ms > settings.silent_ms_max:
            return Drop(
                "silent",
                f"subscriber silent for {silent_ms / 1000:.1f}s "
                f"(keepalive every {settings.keepalive_ms / 1000}s)",
            )
        if buffered >= settings.buffer_messages:
            if self._full_since_ms is None:
                self._full_since_ms = now_ms
            if now_ms - self._full_since_ms >= settings.stall_ms:
                return Drop(
                    "slow",
                    f"subscriber too slow: its buffer of {settings.buffer_messages} messages "
                    f"stayed full for {settings.stall_ms / 1000}s; resume from the last token",
                )
            return WaitUntil(min(self._full_since_ms + settings.stall_ms, self._silence_ends()))
        self._full_since_ms = None
        return None

    def idle(self, now_ms: int) -> SendKeepalive | WaitUntil:
        """Nothing else to send: a keepalive when due, else when to look again."""
        if now_ms - self._last_sent_ms >= self.settings.keepalive_ms:
            self._last_sent_ms = now_ms
            return SendKeepalive()
        return WaitUntil(
            min(self._last_sent_ms + self.settings.keepalive_ms, self._silence_ends())
        )

    def _silence_ends(self) -> int:
        return self._last_heard_ms + self.settings.silent_ms_max + 1
