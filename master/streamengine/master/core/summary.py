"""The streams in a cluster's status: counts per tenant by health, and a bounded list
of rows, the unhealthy ones first.

A status (GetClusterStatus, `streamengine status`, the console) is read every second by
dashboards: with one row per stream it would cost the master's loop, the wire and the
reader time in proportion to every idle stream. So it carries:

- **counts**, per tenant: its streams, and how many of them are under-replicated,
  sealing or deleted (each stream counted once, under its worst health);
- **rows**: at most `STATUS_STREAMS_MAX` streams, the unhealthy ones first (worst
  first, then by name), the rest filled in name order. ListStreams pages through all.

The shell hands in what its indexes already hold (streams per tenant, the few streams
that are flagged, the names in order), so a summary costs the unhealthy streams and
the tenants, not the streams.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

# Stream rows in a status: a screen's worth, enough for every unhealthy stream of a
# cluster in trouble to be seen first.
STATUS_STREAMS_MAX = 100


class Health(enum.IntEnum):
    """Worst first: a stream with several problems is counted under the first."""

    # A sealed segment with fewer good replicas than its policy asks, one lacking.
    UNDER_REPLICATED = 0
    # More than one segment not sealed: a roll or a recovery not finished.
    SEALING = 1
    # Deleted, its data still on the stores until its grace ends.
    DELETED = 2
    OK = 3


@dataclass(frozen=True, slots=True)
class TenantCounts:
    tenant: str
    streams: int
    under_replicated: int = 0
    sealing: int = 0
    deleted: int = 0


@dataclass(frozen=True, slots=True)
class Summary:
    tenants: tuple[TenantCounts, ...]  # by tenant name
    rows: tuple[str, ...]  # stream names, as shown


def worst(flags: Iterable[tuple[str, Health]]) -> dict[str, Health]:
    """Each flagged stream with the worst of its flags."""
    out: dict[str, Health] = {}
    for name, health in flags:
        out[name] = min(health, out.get(name, Health.OK))
    return out


def summarise(
    tenant_streams: Mapping[str, int],
    flagged: Mapping[str, Health],
    names_in_order: Iterable[str],
    rows_max: int = STATUS_STREAMS_MAX,
) -> Summary:
    """`tenant_streams`: streams per tenant; `flagged`: the streams not OK, with their
    worst health (`worst`); `names_in_order`: every stream's name, ascending, read only
    as far as the rows need."""
    assert rows_max >= 0
    counts: dict[str, dict[Health, int]] = {}
    for name, health in flagged.items():
        assert health is not Health.OK, name
        per_tenant = counts.setdefault(name.split("/", 1)[0], {})
        per_tenant[health] = per_tenant.get(health, 0) + 1
    tenants = []
    for tenant in sorted(tenant_streams):
        per_tenant = counts.get(tenant, {})
        tenants.append(
            TenantCounts(
                tenant,
                tenant_streams[tenant],
                under_replicated=per_tenant.get(Health.UNDER_REPLICATED, 0),
                sealing=per_tenant.get(Health.SEALING, 0),
                deleted=per_tenant.get(Health.DELETED, 0),
            )
        )
        assert sum(per_tenant.values()) <= tenant_streams[tenant], tenant
    rows = sorted(flagged, key=lambda name: (flagged[name], name))[:rows_max]
    healthy = (name for name in names_in_order if name not in flagged)
    rows += itertools.islice(healthy, rows_max - len(rows))
    return Summary(tuple(tenants), tuple(rows))
