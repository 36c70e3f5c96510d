"""The streams of a cluster's status (`streamengine.master.core.summary`): counts per
tenant by worst health and bounded rows, the unhealthy first; then as `MasterState`
builds them from its indexes."""

from __future__ import annotations

import pytest

from streamengine.master.core import summary
from streamengine.master.core.summary import Health, TenantCounts
from tests.unit.test_master_state import Master

NAMES = ["a/1", "a/2", "a/3", "b/1", "b/2", "c/1"]
TOTALS = {"a": 3, "b": 2, "c": 1}


@pytest.mark.parametrize(
    ("rule", "flags", "rows_max", "rows"),
    [
        ("all healthy: the first names in order", [], 4, ("a/1", "a/2", "a/3", "b/1")),
        (
            "the unhealthy first, worst first, then the rest in order",
            [("b/2", Health.DELETED), ("c/1", Health.UNDER_REPLICATED), ("a/2", Health.SEALING)],
            5,
            ("c/1", "a/2", "b/2", "a/1", "a/3"),
        ),
        (
            "more unhealthy than rows: only the worst",
            [("b/2", Health.DELETED), ("c/1", Health.SEALING), ("a/2", Health.SEALING)],
            2,
            ("a/2", "c/1"),
        ),
        ("no rows at all", [("a/1", Health.DELETED)], 0, ()),
        ("fewer streams than rows: every one", [], 100, tuple(NAMES)),
    ],
)
def test_rows_are_bounded_and_show_the_unhealthy_first(rule, flags, rows_max, rows) -> None:
    shown = summary.summarise(TOTALS, summary.worst(flags), iter(NAMES), rows_max)
    assert shown.rows == rows, rule


def test_each_stream_is_counted_once_under_its_worst_health() -> None:
    flags = [
        ("a/1", Health.DELETED),
        ("a/1", Health.UNDER_REPLICATED),
        ("a/2", Health.SEALING),
        ("a/2", Health.DELETED),
        ("b/1", Health.DELETED),
    ]
    shown = summary.summarise(TOTALS, summary.worst(flags), iter(NAMES))
    assert shown.tenants == (
        TenantCounts("a", 3, under_replicated=1, sealing=1),
        TenantCounts("b", 2, deleted=1),
        TenantCounts("c", 1),
    )


def test_the_names_are_read_only_as_far_as_the_rows_need() -> None:
    read = []

    def names():
        for name in NAMES:
            read.append(name)
            yield name

    summary.summarise(TOTALS, {"a/1": Health.DELETED}, names(), rows_max=2)
    assert read == ["a/1", "a/2"]


def test_the_state_flags_deleted_and_sealing_streams_of_the_tenant_asked(metadata_place) -> None:
    m = Master(metadata_place)
    for name in ("t/a", "t/b", "u/c"):
        m.state.tenancy.create_stream(name, 3, 2, 0, 0, True, m.now)
    m.state.tenancy.delete_stream("t/b", m.now)
    m.state.sealing[m.state.streams["u/c"].stream_id] = None
    everyone = m.state.tenancy.summarise([])
    assert everyone.rows == ("u/c", "t/b", "t/a")
    assert everyone.tenants == (TenantCounts("t", 2, deleted=1), TenantCounts("u", 1, sealing=1))
    tenant = m.state.tenancy.summarise([], "t")
    assert tenant.rows == ("t/b", "t/a") and tenant.tenants == (TenantCounts("t", 2, deleted=1),)
