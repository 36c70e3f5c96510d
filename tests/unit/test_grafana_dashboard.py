"""The Grafana dashboard charts only metrics the processes serve (no drift)."""

from __future__ import annotations

import json
import re

from prometheus_client import REGISTRY, CollectorRegistry

from streamengine.master.metrics import Metrics
from streamengine.segment_store import metrics as store_metrics  # registers the store's
from tests.tree import ROOT

DASHBOARD = ROOT / "deploy" / "grafana" / "streamengine.json"


def served(registry: CollectorRegistry) -> set[str]:
    """Every sample name the registry serves (`_total`, `_bucket`... included)."""
    return set(registry._names_to_collectors)


def test_every_metric_of_the_dashboard_is_served() -> None:
    assert store_metrics.WRITE_ENTRIES is not None
    known = served(Metrics.create().registry) | served(REGISTRY)
    dashboard = json.loads(DASHBOARD.read_text())
    used = {
        name
        for panel in dashboard["panels"]
        for target in panel["targets"]
        for name in re.findall(r"streamengine_[a-z_]+", target["expr"])
    }
    assert used, "the dashboard charts nothing"
    assert used <= known, f"not served by any process: {sorted(used - known)}"
    assert len({panel["id"] for panel in dashboard["panels"]}) == len(dashboard["panels"])
