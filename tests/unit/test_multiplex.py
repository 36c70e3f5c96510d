"""Following many streams (`client.core.multiplex`): which streams, when each one's
segment list is read again, and when each cursor is looked at; and what the shell
(`client.multiplex`) takes of a list's answer."""

from __future__ import annotations

from typing import Any, cast

import pytest

from streamengine.client import multiplex
from streamengine.client.core.multiplex import (
    LIST_BACKSTOP_MS,
    STALLED_RELIST_MS,
    Changes,
    Directory,
    Selection,
    StreamSummary,
    WakeSchedule,
)
from streamengine.client.core.subscription import Cursor, SegmentView, StreamEvent
from streamengine.client.errors import DataLossError, StreamDeleted
from streamengine.protocol.sequence import pack_sequence


def summary(
    name: str, epoch: int = 1, unsealed: int = 1, deleted: bool = False, stream_id: int = 7
) -> StreamSummary:
    return StreamSummary(name, epoch, epoch, unsealed, 0, deleted, stream_id)


def test_a_selection_names_streams_or_a_prefix_never_both() -> None:
    with pytest.raises(ValueError):
        Selection(("t/a",), "t/")
    with pytest.raises(ValueError):
        Selection()
    with pytest.raises(ValueError):
        Selection(("t/a", "t/a"))
    assert Selection(prefix="t/orders-").tenant == "t"
    assert Selection(prefix="t").tenant == ""  # a prefix of tenant names: list them all
    assert Selection(("t/a", "t/b")).tenant == "t"
    assert Selection(("t/a", "u/b")).tenant == ""
    assert Selection(prefix="t/o").covers("t/orders") and not Selection(prefix="t/o").covers("t/x")


def test_streams_created_under_the_prefix_are_added_and_deleted_ones_removed() -> None:
    directory = Directory(Selection(prefix="t/"))
    first = directory.on_streams([summary("t/a"), summary("u/x")], 0)
    assert first == Changes(added=("t/a",))
    directory.on_list_started("t/a", 0)
    second = directory.on_streams([summary("t/a"), summary("t/b")], 1000)
    assert second == Changes(added=("t/b",))
    third = directory.on_streams([summary("t/a", deleted=True), summary("t/b")], 2000)
    assert third.removed == ("t/a",) and directory.streams == ["t/b"]


@pytest.mark.parametrize("selection", [Selection(prefix="t/"), Selection(("t/a",))])
def test_a_stream_undeleted_goes_on_from_where_it_was_left(selection: Selection) -> None:
    """Runtime seed 26 found it (a follower of "t0/" reading 3/1 again after 3/5): a
    stream deleted and undeleted under a prefix was followed again from the position
    the subscription began at, handing out again what it had handed out."""
    directory = Directory(selection)
    if selection.prefix is None:
        directory.follow(["t/a"])
    directory.on_streams([summary("t/a")], 0)
    directory.on_list_started("t/a", 0)
    left_at = pack_sequence(3, 5)
    # Its tail ended (deleted) before a stream list said so: the shell forgets it.
    directory.forget("t/a", left_at)
    assert directory.on_streams([summary("t/a", deleted=True)], 1000) == Changes()
    assert directory.on_streams([summary("t/a")], 2000) == Changes(resumed=(("t/a", left_at),))
    assert directory.streams == ["t/a"]
    # A stream list says it is deleted first: removed, then left where the shell says.
    directory.on_list_started("t/a", 2000)
    assert directory.on_streams([summary("t/a", deleted=True)], 3000).removed == ("t/a",)
    directory.forget("t/a", left_at + 1)
    assert directory.on_streams([summary("t/a")], 4000).resumed == (("t/a", left_at + 1),)


def test_a_stream_created_again_under_its_name_is_not_resumed() -> None:
    prefixed = Directory(Selection(prefix="t/"))
    named = Directory(Selection(("t/a",)))
    named.follow(["t/a"])
    for directory in (prefixed, named):
        directory.on_streams([summary("t/a")], 0)
        directory.forget("t/a", pack_sequence(3, 5))
    # Another stream of that name (a new id): under the prefix it is new, all of it.
    assert prefixed.on_streams([summary("t/a", stream_id=8)], 1000) == Changes(added=("t/a",))
    assert named.on_streams([summary("t/a", stream_id=8)], 1000) == Changes()
    # Removed for good (gone from the list): what was left of it is forgotten too.
    gone = Directory(Selection(("t/a",)))
    gone.follow(["t/a"])
    gone.on_streams([summary("t/a")], 0)
    gone.forget("t/a", pack_sequence(3, 5))
    gone.on_streams([], 1000)
    assert gone.on_streams([summary("t/a")], 2000) == Changes()


def test_named_streams_are_never_joined_by_others() -> None:
    directory = Directory(Selection(("t/a",)))
    directory.follow(["t/a"])
    assert directory.on_streams([summary("t/a"), summary("t/b")], 0) == Changes()
    assert directory.streams == ["t/a"]


def test_a_list_is_read_again_when_the_summary_changes_or_at_the_backstop() -> None:
    directory = Directory(Selection(prefix="t/"))
    directory.on_streams([summary("t/a")], 0)
    assert directory.relist_due("t/a", 0)  # never listed
    directory.on_list_started("t/a", 0)
    assert not directory.relist_due("t/a", 500)
    # Appends change no summary: the list held stays current, and the cursor hears so.
    directory.on_streams([summary("t/a")], 1000)
    assert not directory.relist_due("t/a", 1000)
    assert directory.unchanged_since_ms("t/a") == 1000
    # A segment added (a roll, a new leader): read it again at once.
    changed = directory.on_streams([summary("t/a", epoch=2, unsealed=2)], 2000)
    assert changed.changed == ("t/a",)
    assert directory.relist_due("t/a", 2000)
    assert directory.unchanged_since_ms("t/a") is None
    directory.on_list_started("t/a", 2000)
    assert not directory.relist_due("t/a", 2000 + LIST_BACKSTOP_MS - 1)
    assert directory.relist_due("t/a", 2000 + LIST_BACKSTOP_MS)
    # A cursor waiting on a listed segment (its replicas failing) asks sooner.
    assert directory.relist_due("t/a", 2000 + STALLED_RELIST_MS, STALLED_RELIST_MS)
    assert directory.relist_at_ms("t/a", STALLED_RELIST_MS) == 2000 + STALLED_RELIST_MS


def test_a_summary_delays_the_cursors_timed_refresh_but_is_no_list() -> None:
    cursor = Cursor(pack_sequence(1, 1))
    cursor.on_segments([SegmentView(1, ("s1",), sealed=False, final_index=0)], 0)
    refresh_ms = cursor.timing.segment_refresh_ms
    assert cursor.refresh_due(refresh_ms)
    cursor.on_list_unchanged(refresh_ms)
    assert not cursor.refresh_due(refresh_ms)
    assert cursor.refresh_due(2 * refresh_ms)


def test_the_wake_schedule_hands_out_each_stream_once_at_its_latest_time() -> None:
    schedule = WakeSchedule()
    schedule.wake("a", 100)
    schedule.wake("b", 50)
    schedule.wake("a", 10)  # replaces 100
    assert schedule.next_ms() == 10
    assert schedule.due(60, limit=10) == ["a", "b"]
    assert schedule.due(1000, limit=10) == []  # a's old 100 was replaced
    for n in range(5):
        schedule.wake(f"s{n}", n)
    assert schedule.due(10, limit=2) == ["s0", "s1"]
    schedule.cancel("s2")
    assert schedule.due(10, limit=10) == ["s3", "s4"]
    assert schedule.next_ms() is None


def test_the_wake_schedule_stays_small_under_many_rewakes() -> None:
    schedule = WakeSchedule()
    for n in range(10_000):
        schedule.wake("a", n)
    assert len(schedule._heap) < 100
    assert schedule.due(10_000, limit=10) == ["a"]


def test_a_list_answered_for_a_stream_left_since_is_not_its_next_followers() -> None:
    """A list still in flight when its stream was left (deleted) and followed again
    (undeleted) answers for the follower that asked: its cursor, or its error, must
    not reach the next one (an old cursor would hand out again what was handed out)."""
    many = multiplex._Multiplexer(cast(Any, None), cast(Any, None), Selection(prefix="t/"), 0, {})
    many._follow("t/a", 0)
    left = many.followed["t/a"].follower
    many._forget("t/a")
    many._follow("t/a", pack_sequence(3, 5))
    many._on_listed(multiplex._Listed("t/a", left, None, StreamDeleted("deleted", 1)))
    many._on_listed(multiplex._Listed("t/a", left, Cursor(0)))
    followed = many.followed["t/a"]
    assert followed.follower is not left and followed.cursor is None and followed.listing


async def test_events_released_in_the_turn_a_stream_fails_go_out_before_the_error() -> None:
    """A cursor that released a segment's last events and, stepped in the same turn,
    decides the next segment's accepted loss: the application gets the events, then
    `DataLossError`, whose resume point is past them (runtime seed 450 lost them)."""
    mux = multiplex._Multiplexer(
        cast(Any, None), cast(Any, None), multiplex.selection_of(["acme/a"], None), 0, {}
    )
    released = [StreamEvent(pack_sequence(1, i), 1, i, b"e", "acme/a") for i in (4, 5)]

    def take(item: object, events: list[StreamEvent], delivered: list[Cursor]) -> None:
        events.extend(released)

    def step(name: str) -> None:
        raise DataLossError(name, 2, 1, 2, accepted=True)

    mux._take = take  # type: ignore[method-assign]
    mux._step = step  # type: ignore[method-assign]
    mux.inbox.put_nowait(cast(Any, "a reply"))
    mux.schedule.wake("acme/a", 0)
    events = mux.events()
    assert await anext(events) == released
    with pytest.raises(DataLossError) as raised:
        await anext(events)
    assert raised.value.resume_sequence == pack_sequence(3, 0)
