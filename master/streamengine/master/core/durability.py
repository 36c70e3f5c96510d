"""Durability debt: how long, and with how many bytes, sealed segments were held by fewer
than N good replicas (one failure closer to loss than the stream asked for), and by fewer
than W copies (fewer than an acknowledgement ever promised).

Pure: the master's loop calls `observe(now_ms, exposures)` about once a second with the
sealed segments that lack good replicas now (a *good* replica as repair judges it: on a
live, non-draining store, acked up to the bridge, and read back equal to the
certificate). Below W counts the copies held, good or *unverified* (at the bridge, not
read back yet): a segment sealed a moment ago is below N until its scrubs report, not
below W, whose alarm is for copies missing. The ledger charges each segment the
time since the previous observation at the level it had then. It counts from the
master's start (it is not persisted): it tells operators how exposed their data has
been lately, not its whole history.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from streamengine.master.core.model import SegmentKey

# Segments kept once healed, for the worst-offenders list: the most indebted ones stay.
HEALED_KEPT_MAX = 1000
# The worst offenders shown by `status` and the console.
DURABILITY_WORST_MAX = 20


@dataclass(frozen=True, slots=True)
class Exposure:
    """A sealed segment with fewer than N good replicas, now."""

    segment: SegmentKey
    stream: str
    good: int
    replicas: int
    write_quorum: int
    bytes: int
    # Copies at the bridge, not read back yet: not good, but held.
    unverified: int = 0
    # No member lacking, only some not judged or read back yet (`repair.being_verified`):
    # status shows it apart from the under-replicated ones; its debt counts all the same.
    verifying: bool = False

    def __post_init__(self) -> None:
        assert 0 <= self.good < self.replicas, self
        assert self.unverified >= 0, self
        assert 1 <= self.write_quorum <= self.replicas, self


@dataclass(slots=True)
class SegmentDebt:
    segment: SegmentKey
    stream: str
    good: int
    replicas: int
    write_quorum: int
    bytes: int
    unverified: int = 0
    below_n_ms: int = 0
    below_w_ms: int = 0
    exposed: bool = True

    @property
    def below_w(self) -> bool:
        return self.good + self.unverified < self.write_quorum


class DurabilityLedger:
    def __init__(self) -> None:
        self._debts: dict[SegmentKey, SegmentDebt] = {}
        self._observed_ms: int | None = None
        self.debt_ms_total = 0  # segment-milliseconds below N, summed over segments

    def observe(self, now_ms: int, exposures: Iterable[Exposure]) -> int:
        """Charge the time since the last observation to the segments exposed then, and
        take `exposures` as what holds from now on. Returns the segment-milliseconds
        below N just charged."""
        elapsed = 0 if self._observed_ms is None else max(0, now_ms - self._observed_ms)
        self._observed_ms = now_ms
        charged = 0
        for debt in self._debts.values():
            if debt.exposed:
                debt.below_n_ms += elapsed
                charged += elapsed
                if debt.below_w:
                    debt.below_w_ms += elapsed
        self.debt_ms_total += charged
        for debt in self._debts.values():
            debt.exposed = False
        for exposure in exposures:
            known = self._debts.get(exposure.segment)
            if known is None:
                self._debts[exposure.segment] = SegmentDebt(
                    exposure.segment,
                    exposure.stream,
                    exposure.good,
                    exposure.replicas,
                    exposure.write_quorum,
                    exposure.bytes,
                    exposure.unverified,
                )
            else:
                known.good, known.bytes, known.exposed = exposure.good, exposure.bytes, True
                known.unverified = exposure.unverified
        self._forget_healed()
        return charged

    def _forget_healed(self) -> None:
        healed = [d for d in self._debts.values() if not d.exposed]
        if len(healed) <= HEALED_KEPT_MAX:
            return
        healed.sort(key=lambda d: d.below_n_ms)
        for debt in healed[: len(healed) - HEALED_KEPT_MAX]:
            del self._debts[debt.segment]

    def forget(self, segments: Iterable[SegmentKey]) -> None:
        """Segments deleted with their stream."""
        for key in segments:
            self._debts.pop(key, None)

    @property
    def bytes_below_n(self) -> int:
        return sum(d.bytes for d in self._debts.values() if d.exposed)

    @property
    def bytes_below_w(self) -> int:
        return sum(d.bytes for d in self._debts.values() if d.exposed and d.below_w)

    def worst(self, count: int) -> list[SegmentDebt]:
        """The segments with the most time below N, exposed now or healed."""
        ranked = sorted(
            self._debts.values(),
            key=lambda d: (-d.below_n_ms, -d.below_w_ms, not d.exposed, d.segment),
        )
        return ranked[:count]
