"""A store's reports of what it holds: whole, then deltas against the last one answered
(`segment_store.core.held_reports`)."""

from __future__ import annotations

from streamengine.segment_store.core.commands import SegmentKey
from streamengine.segment_store.core.held_reports import FULL_REPORT_MS, HeldReports, Reported

A, B, C = SegmentKey(1, 1), SegmentKey(1, 2), SegmentKey(2, 1)


def held(**acked: int) -> dict[SegmentKey, Reported]:
    keys = {"a": A, "b": B, "c": C}
    return {keys[name]: Reported(0, index, index, 10 * index, 1) for name, index in acked.items()}


def test_whole_until_the_master_takes_deltas_then_what_changed_since_its_answer() -> None:
    reports = HeldReports()
    first = reports.report(held(a=1, b=1), 0)
    assert first.full and set(first.changed) == {A, B}
    reports.answered(first, 0, deltas_taken=False, report_full=False)
    assert reports.report(held(a=1, b=1), 10).full, "a master that never said it takes them"
    reports.answered(reports.report(held(a=1, b=1), 10), 10, True, False)
    delta = reports.report(held(a=2, c=1), 20)
    assert not delta.full and set(delta.changed) == {A, C} and delta.removed == (B,)
    # Its answer is lost: the next delta still carries it all.
    again = reports.report(held(a=2, c=1), 30)
    assert set(again.changed) == {A, C} and again.removed == (B,)
    reports.answered(again, 30, True, False)
    quiet = reports.report(held(a=2, c=1), 40)
    assert not quiet.full and not quiet.changed and not quiet.removed


def test_whole_again_every_full_report_time_when_asked_and_after_registering() -> None:
    reports = HeldReports()
    whole = reports.report(held(a=1), 0)
    reports.answered(whole, 0, True, False)
    assert not reports.report(held(a=1), FULL_REPORT_MS - 1).full
    assert reports.report(held(a=1), FULL_REPORT_MS).full
    delta = reports.report(held(a=2), 10)
    reports.answered(delta, 10, True, report_full=True)  # a master newly active
    assert reports.report(held(a=2), 20).full
    reports.answered(reports.report(held(a=2), 20), 20, True, False)
    reports.forget()  # registered again
    assert reports.report(held(a=2), 30).full
