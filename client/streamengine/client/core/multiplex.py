"""Following many streams at once (`StreamClient.subscribe_many`): which streams, when
each one's cursor is looked at, and when its segment list is read again.

Theory of operation. Each stream keeps its own `core.subscription.Cursor`: segment hops,
replica choice, data loss and trims are decided there, as for one stream. What is new
is only what many streams share:

- *Which streams* (`Selection`, `Directory`): named ones, or every stream whose name
  starts with a prefix. The master's stream list (one `ListStreams` call for all of
  them, every `DISCOVERY_MS`) adds the streams created under the prefix since, drops
  the deleted ones, and gives each stream a *summary*: its latest epoch, open segment,
  unsealed segments and trim. A summary changes when a segment is added, sealed or
  trimmed, and not when events are appended. A stream left while deleted (named or
  under the prefix) and undeleted since is followed again from where it was left,
  never from its start again: what was handed out before is never handed out twice.
- *When to read a stream's segment list again* (`Directory.relist_due`). A cursor asks
  for the list on a timer while it tails (`Cursor.refresh_due`) and on every `Wait`:
  one `ListSegments` a second per stream, 10,000 a second for 10,000 streams. Here the
  list is read again when the stream's summary changed since it was read, or when it
  is older than `LIST_BACKSTOP_MS` (the stream list may fail, or trail), or
  `STALLED_RELIST_MS` while the cursor waits on a segment it has listed (its replicas
  failed: a repair may have moved them); meanwhile `Cursor.on_list_unchanged` tells the
  cursor that its list is current, which delays its timed refresh and nothing else
  (data loss still waits for a list read after the replicas' answers).
- *When to look at each cursor* (`WakeSchedule`): at the time it asked to be woken, or
  when something arrived for it; never all of them on every turn.

No I/O, no clock: the shell (`streamengine.client.multiplex`) passes `now_ms`.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

# How often the master's stream list is read: a stream created under a prefix, or a
# segment added or sealed, is seen this long after at most (plus one list call).
DISCOVERY_MS = 1000
# A stream's segment list is read again at least this often, whatever its summary says
# (the stream list may fail, or miss a change of a copy set): 10,000 streams make 170
# list calls a second of it.
LIST_BACKSTOP_MS = 60_000
# ... and this often while its cursor waits on a segment it has listed (its replicas
# fail, or it needs a list read after their answers to tell data loss): as a lone
# follower does (`FollowerTiming.segment_refresh_ms`), for the few streams in trouble.
STALLED_RELIST_MS = 1000
# Segment lists read at once: the master answers them in turn anyway, and a reader
# starting on 10,000 streams must not open 10,000 calls to it.
LIST_CALLS_MAX = 16

assert DISCOVERY_MS < LIST_BACKSTOP_MS and STALLED_RELIST_MS < LIST_BACKSTOP_MS


@dataclass(frozen=True, slots=True)
class Selection:
    """The streams a subscription follows: `names`, or (when `prefix` is not None)
    every stream whose name starts with `prefix`, now and created later."""

    names: tuple[str, ...] = ()
    prefix: str | None = None

    def __post_init__(self) -> None:
        if (self.prefix is None) == (not self.names):
            raise ValueError("follow either named streams or a prefix, not both nor neither")
        if len(set(self.names)) != len(self.names):
            raise ValueError("a stream is named twice")

    @property
    def tenant(self) -> str:
        """The tenant to list, when the selection lies within one ("" for all)."""
        if self.prefix is not None:
            tenant, slash, _ = self.prefix.partition("/")
            return tenant if slash else ""
        tenants = {name.partition("/")[0] for name in self.names}
        return tenants.pop() if len(tenants) == 1 else ""

    def covers(self, name: str) -> bool:
        if self.prefix is not None:
            return name.startswith(self.prefix)
        return name in self.names


@dataclass(frozen=True, slots=True)
class StreamSummary:
    """What the master's stream list says of one stream, as far as a reader cares."""

    name: str
    epoch: int
    open_segment_epoch: int
    unsealed_segments: int
    trimmed_through_epoch: int
    deleted: bool = False
    stream_id: int = 0


@dataclass(frozen=True, slots=True)
class Changes:
    """What a stream list changed: streams to follow from now on (created under the
    prefix, or named and seen), streams gone (deleted), streams whose segments changed."""

    added: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()
    changed: tuple[str, ...] = ()
    # Streams left while deleted and undeleted since: follow each again from the
    # position it was left at (`Directory.forget`).
    resumed: tuple[tuple[str, int], ...] = ()


@dataclass(slots=True)
class _Known:
    summary: StreamSummary | None = None
    # Bumped when the summary changes; what the held segment list was read under.
    version: int = 0
    listed_version: int = -1
    listed_ms: int | None = None
    # When a stream list last named it (its summary is as current as that).
    summarized_ms: int | None = None


class Directory:
    """The streams followed, their summaries, and when each one's list is due."""

    def __init__(self, selection: Selection) -> None:
        self.selection = selection
        self._known: dict[str, _Known] = {}
        # Streams no longer followed as deleted: their id and the position they were
        # left at (None until the shell tells it, `forget`), should they be undeleted.
        self._left: dict[str, tuple[int, int | None]] = {}

    @property
    def streams(self) -> list[str]:
        """The streams followed, in name order."""
        return sorted(self._known)

    def follow(self, names: Iterable[str]) -> None:
        """Follow `names` from now on (the named streams at the start)."""
        for name in names:
            assert self.selection.covers(name)
            self._known.setdefault(name, _Known())

    def on_streams(self, summaries: Sequence[StreamSummary], now_ms: int) -> Changes:
        """The master's stream list (a whole tenant's, or every one), as read at
        `now_ms`: what changed."""
        seen: set[str] = set()
        added: list[str] = []
        changed: list[str] = []
        removed: list[str] = []
        resumed: list[tuple[str, int]] = []
        for summary in summaries:
            name = summary.name
            if not self.selection.covers(name):
                continue
            seen.add(name)
            known = self._known.get(name)
            if summary.deleted:
                if known is not None:
                    del self._known[name]
                    removed.append(name)
                    self._left[name] = (summary.stream_id, None)
                continue
            if known is None:
                position = self._position_left(name, summary.stream_id)
                if position is not None:
                    resumed.append((name, position))
                elif self.selection.prefix is None:
                    continue  # named streams are followed from the start only
                else:
                    added.append(name)
                known = self._known[name] = _Known()
            known.summarized_ms = now_ms
            if known.summary != summary:
                if known.summary is not None:
                    changed.append(name)
                known.summary = summary
                known.version += 1
        if self.selection.prefix is not None:
            # Gone from the list: deleted and forgotten (never seen: not created yet).
            removed += [n for n in sorted(self._known) if n not in seen and self._listed(n)]
            for name in removed:
                self._known.pop(name, None)
        for name in [n for n in self._left if n not in seen]:
            del self._left[name]  # removed for good: a stream of that name is another
        return Changes(tuple(added), tuple(sorted(set(removed))), tuple(changed), tuple(resumed))

    def _listed(self, name: str) -> bool:
        return self._known[name].listed_ms is not None

    def _position_left(self, name: str, stream_id: int) -> int | None:
        """Where `name` was left when it was deleted, if this is the same stream (a
        stream created again under its name starts afresh)."""
        left = self._left.pop(name, None)
        if left is None or left[0] != stream_id or not stream_id:
            return None
        return left[1]

    def forget(self, name: str, position: int | None = None) -> None:
        """No longer follow `name` (deleted, or gone); `position`: what it would hand
        out next, where it goes on should a later stream list show it undeleted."""
        known = self._known.pop(name, None)
        if known is not None and known.summary is not None:
            stream_id = known.summary.stream_id
        else:
            stream_id = self._left.get(name, (0, None))[0]
        if position is not None and stream_id:
            self._left[name] = (stream_id, position)

    def on_list_started(self, name: str, now_ms: int) -> None:
        """A `ListSegments` of `name` starts: what it answers is as current as this."""
        known = self._known.get(name)
        if known is not None:
            known.listed_version = known.version
            known.listed_ms = now_ms

    def relist_due(self, name: str, now_ms: int, backstop_ms: int = LIST_BACKSTOP_MS) -> bool:
        """Whether the segment list held for `name` may be stale: its summary changed
        since it was read (or none is known), or it is older than `backstop_ms`."""
        known = self._known.get(name)
        if known is None:
            return False
        if known.listed_ms is None or known.summary is None:
            return True
        if known.version != known.listed_version:
            return True
        return now_ms - known.listed_ms >= backstop_ms

    def unchanged_since_ms(self, name: str) -> int | None:
        """Until when the stream list says the segment list held for `name` is current
        (`Cursor.on_list_unchanged`); None when it cannot say."""
        known = self._known.get(name)
        if known is None or known.summarized_ms is None or known.version != known.listed_version:
            return None
        return known.summarized_ms

    def relist_at_ms(self, name: str, backstop_ms: int = LIST_BACKSTOP_MS) -> int | None:
        """When the list of `name` is due at the latest, its summary unchanged."""
        known = self._known.get(name)
        if known is None or known.listed_ms is None:
            return None
        return known.listed_ms + backstop_ms


@dataclass(slots=True)
class WakeSchedule:
    """When to look at each stream's cursor: the earliest time asked for each, kept in
    a heap (a later request for the same stream replaces an earlier one lazily)."""

    _heap: list[tuple[int, int, str]] = field(default_factory=list)
    _at: dict[str, tuple[int, int]] = field(default_factory=dict)
    _count: int = 0

    def wake(self, name: str, at_ms: int) -> None:
        """Look at `name` at `at_ms` (replacing any other time asked)."""
        self._count += 1
        self._at[name] = (at_ms, self._count)
        heapq.heappush(self._heap, (at_ms, self._count, name))
        if len(self._heap) > 4 * len(self._at) + 64:
            self._compact()

    def cancel(self, name: str) -> None:
        self._at.pop(name, None)

    def due(self, now_ms: int, limit: int) -> list[str]:
        """Up to `limit` streams due at `now_ms`, earliest first (each once)."""
        due: list[str] = []
        while self._heap and self._heap[0][0] <= now_ms and len(due) < limit:
            at_ms, count, name = heapq.heappop(self._heap)
            if self._at.get(name) == (at_ms, count):
                del self._at[name]
                due.append(name)
        return due

    def next_ms(self) -> int | None:
        """When the next stream is due (None: none is)."""
        while self._heap:
            at_ms, count, name = self._heap[0]
            if self._at.get(name) == (at_ms, count):
                return at_ms
            heapq.heappop(self._heap)
        return None

    def _compact(self) -> None:
        self._heap = [(at, count, name) for name, (at, count) in self._at.items()]
        heapq.heapify(self._heap)
