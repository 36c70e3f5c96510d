"""The routing table of a store's shared Write stream (`client.core.store_session`):
where each reply goes, what a refusal means, and each segment's bound on the stream."""

from __future__ import annotations

import asyncio

import pytest

from streamengine.client.core.replicator import (
    StoreConnected,
    StoreDisconnected,
    WriteReplied,
    WritesReplied,
)
from streamengine.client.core.store_session import (
    SEGMENT_IN_FLIGHT_MAX,
    MessageParts,
    RouteRefused,
    SessionRoutes,
    batched,
    reopen_pause_ms,
)
from streamengine.client.core.writer import FencedByStore
from streamengine.client.store_session import Inbox
from streamengine.protocol.backoff import STORE_STREAM_REOPEN
from streamengine.protocol.limits import (
    WRITE_BATCH_BYTES_MAX,
    WRITE_BATCH_ENTRIES_MAX,
    WRITE_REQUEST_PARTS_MAX,
)
from streamengine.protocol.status import FENCE_UNKNOWN

A = (1, 1)  # (stream id, epoch)
B = (2, 1)


class Writer:
    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


@pytest.fixture
def routes() -> tuple[SessionRoutes[Writer, str], Writer, Writer]:
    table: SessionRoutes[Writer, str] = SessionRoutes(in_flight_max=2)
    a, b = Writer("a"), Writer("b")
    table.attach(A, a)
    table.attach(B, b)
    return table, a, b


def test_routes_open_when_the_stream_connects_and_close_when_it_breaks(routes) -> None:
    table, a, b = routes
    assert table.send(A, 1, "a1") is None, "closed: the owner holds the store disconnected"
    assert table.open_all() == [(A, a), (B, b)]
    assert table.open_all() == [], "open already: nobody hears it twice"
    assert table.send(A, 1, "a1") == "a1"
    assert table.stream_lost() == [(A, a), (B, b)]
    assert table.stream_lost() == [], "closed already"
    assert table.in_flight(A) == 0


def test_a_reply_goes_to_its_segments_owner_and_answers_everything_before_it(routes) -> None:
    table, a, b = routes
    table.open_all()
    table.send(A, 1, "a1")
    table.send(A, 2, "a2")
    table.send(B, 1, "b1")
    assert table.replied(B, 1) == (b, [])
    assert table.in_flight(A) == 2
    assert table.replied(A, 2) == (a, []), "answers in order: 1 and 2"
    assert table.in_flight(A) == 0


@pytest.mark.parametrize(
    ("sent", "bound", "held"),
    [
        (1, 2, 0),
        (2, 2, 0),
        (3, 2, 1),
        (7, 2, 5),
        (SEGMENT_IN_FLIGHT_MAX + 1, SEGMENT_IN_FLIGHT_MAX, 1),
    ],
)
def test_a_segment_has_at_most_its_bound_out_and_the_rest_waits_in_order(
    sent: int, bound: int, held: int
) -> None:
    table: SessionRoutes[Writer, int] = SessionRoutes(in_flight_max=bound)
    owner = Writer("a")
    table.attach(A, owner)
    table.open(A)
    out = [item for n in range(1, sent + 1) if (item := table.send(A, n, n)) is not None]
    assert out == list(range(1, min(sent, bound) + 1))
    assert table.waiting(A) == held
    released = []
    for request_id in range(1, sent + 1):
        _, more = table.replied(A, request_id)
        released += more
    assert released == list(range(bound + 1, sent + 1)), "the waiting ones, in order"


def test_one_busy_segment_never_holds_another_back(routes) -> None:
    table, _, _ = routes
    table.open_all()
    for n in range(1, 10):
        table.send(A, n, f"a{n}")
    assert table.in_flight(A) == 2 and table.waiting(A) == 7
    assert table.send(B, 1, "b1") == "b1", "B's first request goes at once"


@pytest.mark.parametrize(
    ("code", "fence", "expected_fence"),
    [
        ("FAILED_PRECONDITION", 7, 7),  # below the fence: the store names it
        ("FAILED_PRECONDITION", None, FENCE_UNKNOWN),  # a deleted stream names none
        ("PERMISSION_DENIED", None, None),  # a bad grant: shown again once it reopens
        ("INVALID_ARGUMENT", None, None),
        ("UNAVAILABLE", None, None),  # no signing key yet, a segment not taken part in
        ("NOT_FOUND", None, None),
        ("RESOURCE_EXHAUSTED", None, None),
    ],
)
def test_what_a_refusal_means_for_its_owner(
    routes, code: str, fence: int | None, expected_fence: int | None
) -> None:
    table, a, b = routes
    table.open_all()
    table.send(A, 1, "a1")
    table.send(B, 1, "b1")
    refused = table.refused(A, 1, code, fence)
    reopen_ms = 0 if expected_fence is not None else STORE_STREAM_REOPEN.delay_ms(1)
    assert refused == RouteRefused(a, expected_fence, reopen_ms)
    assert not table.is_open(A)
    assert table.is_open(B) and table.replied(B, 1) == (b, []), "the other segment goes on"


def test_a_route_refused_again_waits_longer_and_an_answer_resets_the_pause(routes) -> None:
    table, a, _ = routes
    table.open_all()
    pauses = []
    for attempt in range(1, 4):
        table.send(A, attempt, "a")
        refused = table.refused(A, attempt, "PERMISSION_DENIED", None)
        assert refused is not None
        pauses.append(refused.reopen_after_ms)
        assert table.open(A) is a
    assert pauses == [STORE_STREAM_REOPEN.delay_ms(n) for n in (1, 2, 3)]
    table.send(A, 10, "a")
    table.replied(A, 10)
    table.send(A, 11, "a")
    refused = table.refused(A, 11, "PERMISSION_DENIED", None)
    assert refused is not None and refused.reopen_after_ms == STORE_STREAM_REOPEN.delay_ms(1)


def test_answers_to_requests_sent_before_a_route_reopened_are_dropped(routes) -> None:
    """Such an answer would tell the owner's reset cursor a stale matched index, or
    close the route again for a refusal already heard."""
    table, a, _ = routes
    table.open_all()
    table.send(A, 1, "a1")
    table.send(A, 2, "a2")
    assert table.refused(A, 1, "PERMISSION_DENIED", None) is not None
    assert table.replied(A, 2) == (None, []), "closed: nobody hears it"
    table.open(A)
    assert table.refused(A, 2, "PERMISSION_DENIED", None) is None, "nothing sent since"
    assert table.replied(A, 2) == (None, [])
    table.send(A, 3, "a3")
    assert table.replied(A, 2) == (None, []), "sent before the reopening"
    assert table.replied(A, 3) == (a, [])


def test_a_detached_segment_hears_nothing_and_its_key_may_be_routed_again(routes) -> None:
    table, a, _ = routes
    table.open_all()
    table.send(A, 1, "a1")
    table.detach(A, Writer("not the owner"))
    assert table.owner(A) is a, "only its owner detaches it"
    table.detach(A, a)
    assert table.replied(A, 1) == (None, [])
    assert table.send(A, 2, "a2") is None
    successor = Writer("a'")
    table.attach(A, successor)
    assert table.open(A) is successor
    assert len(table) == 2


def test_a_segment_has_one_owner() -> None:
    table: SessionRoutes[Writer, str] = SessionRoutes()
    table.attach(A, Writer("a"))
    with pytest.raises(AssertionError):
        table.attach(A, Writer("b"))


@pytest.mark.parametrize(
    ("requests", "joined"),
    [
        # (entries, bytes) of each request queued, in order: how many share a message.
        pytest.param([(1, 100)] * 3, 3, id="single-appends-share-one-message"),
        pytest.param([(0, 60)] * 2, 2, id="acked-index-ticks-too"),
        pytest.param(
            [(0, 10)] * (WRITE_REQUEST_PARTS_MAX + 1), WRITE_REQUEST_PARTS_MAX, id="parts-bound"
        ),
        pytest.param(
            [(WRITE_BATCH_ENTRIES_MAX - 1, 100), (1, 100), (1, 100)], 2, id="entries-bound"
        ),
        pytest.param([(1, WRITE_BATCH_BYTES_MAX - 10), (1, 10), (1, 1)], 2, id="bytes-bound"),
        pytest.param(
            [(WRITE_BATCH_ENTRIES_MAX + 5, WRITE_BATCH_BYTES_MAX + 5), (1, 1)],
            1,
            id="a-request-over-the-bounds-goes-alone",
        ),
    ],
)
def test_queued_requests_share_a_message_within_its_bounds(
    requests: list[tuple[int, int]], joined: int
) -> None:
    message = MessageParts()
    taken = [message.join(entries, size_bytes) for entries, size_bytes in requests]
    assert taken.count(True) == joined
    assert taken == [True] * joined + [False] * (len(requests) - joined)
    assert message.parts == joined
    if joined < len(requests):
        assert MessageParts().join(*requests[joined]), "the one left out starts the next"


def _answer(store: str, request_id: int) -> WriteReplied:
    return WriteReplied(store, request_id, False, request_id, 0)


S1_1, S2_1, S3_1, S1_2 = _answer("s1", 1), _answer("s2", 1), _answer("s3", 1), _answer("s1", 2)
DOWN = StoreDisconnected("s2")
UP = StoreConnected("s2")
FENCED = FencedByStore("s3", 9)


@pytest.mark.parametrize(
    ("told", "stepped"),
    [
        ([], []),
        ([S1_1], [S1_1]),
        # Every store's answers since the last hand-over: one step.
        ([S1_1, S2_1, S3_1, S1_2], [WritesReplied((S1_1, S2_1, S3_1, S1_2))]),
        # A connection event keeps its place between the answers around it.
        ([S1_1, DOWN, S3_1, S1_2], [S1_1, DOWN, WritesReplied((S3_1, S1_2))]),
        ([UP, S1_1, S2_1, FENCED], [UP, WritesReplied((S1_1, S2_1)), FENCED]),
        ([DOWN, UP], [DOWN, UP]),
    ],
)
def test_a_writer_steps_once_for_each_run_of_answers(told: list, stepped: list) -> None:  # type: ignore[type-arg]
    assert batched(told) == stepped


def test_the_inbox_hands_a_segment_s_events_only_to_an_owner_still_holding_it() -> None:
    """Answers wait for the loop's next turn: a writer that rolled away from a segment
    meanwhile (its new copy set without that store) never hears them. Before, such an
    answer reached the new segment's replicator and ended the writer with KeyError
    (fault scenario S17: appends stalled 3-5 s after a master's fault)."""
    old, new = (7, 1), (7, 2)
    routes: SessionRoutes = SessionRoutes()  # type: ignore[type-arg]
    heard: list[object] = []

    class Owner:
        def store_event(self, event: object) -> None:
            heard.append(event)
            routes.detach(old, self)  # the new segment's answer: the old one is sealed away

    owner = Owner()
    routes.attach(old, owner)
    routes.attach(new, owner)

    async def scenario() -> None:
        inbox = Inbox()
        for key in (new, old, old):
            reply = WriteReplied("s1", 1, False, 1, 1)
            inbox.put(owner, "s1", key, reply, routes)
        await asyncio.sleep(0)

    asyncio.run(scenario())
    assert len(heard) == 1 and isinstance(heard[0], WriteReplied)


@pytest.mark.parametrize(
    ("failures", "unanswered_dial", "pause_ms"),
    [
        (1, False, 50),
        (3, False, 200),
        (9, False, 1_000),
        (1, True, 0),
        (9, True, 0),
    ],
)
def test_a_write_stream_dials_again_at_once_after_a_dial_nobody_answered(
    failures: int, unanswered_dial: bool, pause_ms: int
) -> None:
    """A refusal or a stream that ended waits out the backoff; a dial that met silence
    for its whole timeout already waited longer, and the next goes at once."""
    assert reopen_pause_ms(failures, unanswered_dial) == pause_ms
    assert pause_ms == (0 if unanswered_dial else STORE_STREAM_REOPEN.delay_ms(failures))
