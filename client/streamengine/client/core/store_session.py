"""One store's Write stream shared by every writer of a client: the routing table.

Theory of operation. A client holds one Write stream per store (`client.store_session`
is the shell), whatever the number of streams it leads: a store serves a bounded
number of calls, and a stream per writer capped a process at a few hundred streams
(issue #38). Each segment a writer replicates to the store is a route, keyed by
(stream id, epoch), owned by that writer's replicator (`client.core.replicator`),
which keeps all replication decisions: this table only says where a reply goes, what
a refusal means, and when a segment's requests may go out.

A route is open while the store takes its requests on the current stream: every route
opens when the stream connects (its owner hears `StoreConnected`), and all close when
the stream breaks (`StoreDisconnected`: its owner resends from the store's matched index,
as after any lost stream). A route also closes alone when the store refuses one of its
requests (`WriteReply.error`): a refusal below the fence (FAILED_PRECONDITION) means
the owner is fenced (`FencedByStore`, with the fence the store names, or
`FENCE_UNKNOWN`); any other (a bad grant, a segment the store takes no part in, bad
input) means the owner hears `StoreDisconnected` and the route opens again after
`STORE_STREAM_REOPEN`'s pause, as a stream of its own used to be reopened. The other
routes go on.

Replies come in order per stream; a reply is matched by (segment, request_id). Replies
to requests sent before a route last closed say nothing about what the store holds
since (the owner reset its cursor): they are dropped here, so the owner sees replies
of its current attachment only. Request ids grow per segment (one replicator numbers
them), so "sent before" is "below the first id sent since the route opened".

Flow control: a route has at most `in_flight_max` requests out on the stream; more
wait in the route's own backlog, in order, until replies make room. The stream's send
queue is first come, first served, so one busy writer never holds more than its bound
ahead of another's requests.

Messages: what the writers queued for the store by the time the stream sends goes out
in one Write message (`WriteRequest.parts`), up to a message's bounds (`MessageParts`):
the cost of spread appends is per gRPC message, not per segment. Nothing waits for
company: the stream sends as soon as it can, so a lone request goes out at once, and
requests queue up (and share a message) only while the stream is busy sending.

Answers: a writer's core costs about as much per step as per answer, and an event is
answered by each store of its copy set, each on its own stream. What every store told
a writer by the time the client hands answers over (once per turn of its loop) is one
list of events, in the order they came; `batched` makes each run of answers in it one
event (`WritesReplied`), so a writer steps once for all of them, and the connection
events between them keep their place.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from streamengine.client.core.replicator import WINDOW_BATCHES, WriteReplied, WritesReplied
from streamengine.client.core.writer import LeaderEvent
from streamengine.protocol.backoff import STORE_STREAM_REOPEN
from streamengine.protocol.limits import (
    WRITE_BATCH_BYTES_MAX,
    WRITE_BATCH_ENTRIES_MAX,
    WRITE_REQUEST_PARTS_MAX,
)
from streamengine.protocol.status import FENCE_UNKNOWN

# Requests one segment may have out on a shared stream. A replicator keeps its own
# window (`WINDOW_BATCHES`); this bounds what any one route takes of the stream whatever
# limits its writer was given, so one writer cannot starve the others.
SEGMENT_IN_FLIGHT_MAX = 16
assert SEGMENT_IN_FLIGHT_MAX >= WINDOW_BATCHES, "the default window never waits here"

# The status a store refuses a write below its fence with (and a deleted stream's).
FENCED_STATUS = "FAILED_PRECONDITION"

RouteKey = tuple[int, int]  # (stream id, segment epoch)

Owner = TypeVar("Owner")
Item = TypeVar("Item")


def batched(events: list[LeaderEvent]) -> list[LeaderEvent]:
    """`events` in order, each run of two or more `WriteReplied` in it made one
    `WritesReplied`."""
    out: list[LeaderEvent] = []
    run: list[WriteReplied] = []
    for event in events:
        if isinstance(event, WriteReplied):
            run.append(event)
            continue
        if run:
            out.append(run[0] if len(run) == 1 else WritesReplied(tuple(run)))
            run = []
        out.append(event)
    if run:
        out.append(run[0] if len(run) == 1 else WritesReplied(tuple(run)))
    return out


def reopen_pause_ms(failures: int, unanswered_dial: bool) -> int:
    """How long a store's Write stream waits before dialling again, after `failures`
    failures in a row: `STORE_STREAM_REOPEN`'s backoff after an answer (a refusal, a
    stream that ended), none after a dial nobody answered before its timeout. That dial
    waited longer than any pause, sending a fresh SYN every `framed.DIAL_HEDGE_MS`,
    and the next at once may cross a cut healed meanwhile (S7 on affe1fc: a pause after
    such a dial missed a heal by over a second)."""
    assert failures >= 1
    return 0 if unanswered_dial else STORE_STREAM_REOPEN.delay_ms(failures)


@dataclass(slots=True)
class MessageParts:
    """What one Write message holds so far, and whether the next request joins it:
    within the store's bounds for a message of parts (`WriteRequest.parts`), counting
    each request's whole serialized size (its grant and fields too) as its bytes, so
    the message stays within the gRPC limit as one batch does. The first request
    always joins: one alone is a batch the replicator already bounded."""

    parts: int = 0
    entries: int = 0
    size_bytes: int = 0

    def join(self, entries: int, size_bytes: int) -> bool:
        """Whether a request of `entries` and `size_bytes` joins the message (counted
        if so); when not, it starts the next one."""
        if self.parts and (
            self.parts + 1 > WRITE_REQUEST_PARTS_MAX
            or self.entries + entries > WRITE_BATCH_ENTRIES_MAX
            or self.size_bytes + size_bytes > WRITE_BATCH_BYTES_MAX
        ):
            return False
        self.parts += 1
        self.entries += entries
        self.size_bytes += size_bytes
        return True


@dataclass(frozen=True, slots=True)
class RouteRefused(Generic[Owner]):
    """A request of a route was refused: its owner is fenced at `fence`, or (None)
    loses the store for the segment until the route opens again in `reopen_after_ms`."""

    owner: Owner
    fence: int | None
    reopen_after_ms: int


@dataclass(slots=True)
class _Route(Generic[Owner, Item]):
    owner: Owner
    open: bool = False
    # Replies to requests below this id predate the route's opening; None: nothing sent
    # since it opened, so every reply does.
    accept_from: int | None = None
    in_flight: deque[int] = field(default_factory=deque)
    backlog: deque[tuple[int, Item]] = field(default_factory=deque)
    refusals: int = 0  # in a row, for the pause before it opens again


class SessionRoutes(Generic[Owner, Item]):
    """The routes of one store's shared Write stream; see the module docstring."""

    def __init__(self, in_flight_max: int = SEGMENT_IN_FLIGHT_MAX) -> None:
        assert in_flight_max >= 1
        self.in_flight_max = in_flight_max
        self._routes: dict[RouteKey, _Route[Owner, Item]] = {}

    def __len__(self) -> int:
        return len(self._routes)

    def owner(self, key: RouteKey) -> Owner | None:
        route = self._routes.get(key)
        return None if route is None else route.owner

    def is_open(self, key: RouteKey) -> bool:
        route = self._routes.get(key)
        return route is not None and route.open

    def in_flight(self, key: RouteKey) -> int:
        route = self._routes.get(key)
        return 0 if route is None else len(route.in_flight)

    def waiting(self, key: RouteKey) -> int:
        route = self._routes.get(key)
        return 0 if route is None else len(route.backlog)

    def attach(self, key: RouteKey, owner: Owner) -> None:
        """`owner` replicates segment `key` to the store from now on (closed until
        `open`). A segment has one owner: its leader."""
        assert key not in self._routes, f"segment {key} is routed already"
        self._routes[key] = _Route(owner)

    def detach(self, key: RouteKey, owner: Owner) -> None:
        """`owner` is done with the segment (rolled, stepped down, closed): its
        replies, and its requests still waiting, go nowhere."""
        route = self._routes.get(key)
        if route is not None and route.owner is owner:
            del self._routes[key]

    def open(self, key: RouteKey) -> Owner | None:
        """The store takes the segment's requests on the current stream: the owner to
        tell (`StoreConnected`), or None when the route is gone or open already."""
        route = self._routes.get(key)
        if route is None or route.open:
            return None
        route.open = True
        route.accept_from = None
        return route.owner

    def open_all(self) -> list[tuple[RouteKey, Owner]]:
        """A stream connected: every route opens; the owners to tell, in attach order."""
        return [(key, owner) for key in list(self._routes) if (owner := self.open(key)) is not None]

    def stream_lost(self) -> list[tuple[RouteKey, Owner]]:
        """The stream broke: whatever was out may be lost, and every route closes. The
        routes that were open and their owners, to tell (`StoreDisconnected`)."""
        told = []
        for key, route in self._routes.items():
            if route.open:
                told.append((key, route.owner))
            self._close(route)
        return told

    def send(self, key: RouteKey, request_id: int, item: Item) -> Item | None:
        """A request of the segment: the item to put on the stream now, or None (it
        waits in the route's backlog for room, or the route is closed or gone: the
        owner then holds the store disconnected and resends once it opens)."""
        route = self._routes.get(key)
        if route is None or not route.open:
            return None
        if route.accept_from is None:
            route.accept_from = request_id
        assert request_id >= route.accept_from, (key, request_id, route.accept_from)
        if route.backlog or len(route.in_flight) >= self.in_flight_max:
            route.backlog.append((request_id, item))
            return None
        route.in_flight.append(request_id)
        return item

    def replied(self, key: RouteKey, request_id: int) -> tuple[Owner | None, list[Item]]:
        """An answer: the owner it goes to (None: stale, or nobody's any more), and the
        requests it made room for, to put on the stream now."""
        route = self._fresh(key, request_id)
        if route is None:
            return None, []
        route.refusals = 0
        return route.owner, self._answered(route, request_id)

    def refused(
        self, key: RouteKey, request_id: int, code: str, fence: int | None
    ) -> RouteRefused[Owner] | None:
        """A refusal (`code`, the status's name; `fence`, the one it names): what it
        means for the owner, or None when it is stale. The route closes."""
        route = self._fresh(key, request_id)
        if route is None:
            return None
        self._close(route)
        route.refusals += 1
        if code == FENCED_STATUS:
            return RouteRefused(route.owner, fence if fence is not None else FENCE_UNKNOWN, 0)
        return RouteRefused(route.owner, None, STORE_STREAM_REOPEN.delay_ms(route.refusals))

    # ---- internals ----

    def _fresh(self, key: RouteKey, request_id: int) -> _Route[Owner, Item] | None:
        route = self._routes.get(key)
        if route is None or not route.open or route.accept_from is None:
            return None
        if request_id < route.accept_from:
            return None
        return route

    def _answered(self, route: _Route[Owner, Item], request_id: int) -> list[Item]:
        # In order: a reply answers every request of its segment up to its own.
        while route.in_flight and route.in_flight[0] <= request_id:
            route.in_flight.popleft()
        released = []
        while route.backlog and len(route.in_flight) < self.in_flight_max:
            waiting_id, item = route.backlog.popleft()
            route.in_flight.append(waiting_id)
            released.append(item)
        return released

    @staticmethod
    def _close(route: _Route[Owner, Item]) -> None:
        route.open = False
        route.accept_from = None
        route.in_flight.clear()
        route.backlog.clear()
