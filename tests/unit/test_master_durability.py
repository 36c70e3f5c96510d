"""Durability debt: time and bytes below N and below W good replicas, per segment."""

from __future__ import annotations

from streamengine.master.core.durability import HEALED_KEPT_MAX, DurabilityLedger, Exposure


def exposed(
    epoch: int, good: int, replicas: int = 3, quorum: int = 2, size: int = 100, unverified: int = 0
) -> Exposure:
    return Exposure((1, epoch), "t/s", good, replicas, quorum, size, unverified)


def test_time_is_charged_at_the_level_the_segment_had() -> None:
    ledger = DurabilityLedger()
    assert ledger.observe(1000, [exposed(1, good=2)]) == 0  # nothing to charge yet
    assert (ledger.bytes_below_n, ledger.bytes_below_w) == (100, 0)
    # One second at 2 of 3 good replicas: below N, not below W.
    assert ledger.observe(2000, [exposed(1, good=1)]) == 1000
    assert (ledger.bytes_below_n, ledger.bytes_below_w) == (100, 100)
    # Half a second at 1 of 3: below both; then repaired.
    ledger.observe(2500, [])
    [debt] = ledger.worst(5)
    assert (debt.below_n_ms, debt.below_w_ms, debt.exposed) == (1500, 500, False)
    assert (ledger.bytes_below_n, ledger.bytes_below_w, ledger.debt_ms_total) == (0, 0, 1500)
    # Healed segments charge nothing more.
    ledger.observe(9000, [])
    assert ledger.worst(5)[0].below_n_ms == 1500


def test_the_worst_offenders_come_first_exposed_before_healed_on_ties() -> None:
    ledger = DurabilityLedger()
    ledger.observe(0, [exposed(1, 2), exposed(2, 1), exposed(3, 2)])
    ledger.observe(1000, [exposed(2, 1), exposed(3, 2)])
    ledger.observe(3000, [exposed(3, 2)])
    assert [(d.segment[1], d.below_n_ms) for d in ledger.worst(3)] == [
        (2, 3000),
        (3, 3000),
        (1, 1000),
    ]
    assert ledger.worst(3)[0].below_w_ms == 3000 and ledger.worst(3)[1].below_w_ms == 0


def test_healed_segments_kept_are_bounded_and_deleted_ones_forgotten() -> None:
    ledger = DurabilityLedger()
    many = [exposed(epoch, 2) for epoch in range(1, HEALED_KEPT_MAX + 50)]
    ledger.observe(0, many)
    ledger.observe(10, [exposed(1, 2)])
    ledger.observe(20, [])
    assert len(ledger.worst(10 * HEALED_KEPT_MAX)) == HEALED_KEPT_MAX
    assert ledger.worst(1)[0].segment == (1, 1)  # the most indebted stays
    ledger.forget([(1, 1)])
    assert all(d.segment != (1, 1) for d in ledger.worst(10 * HEALED_KEPT_MAX))


def test_copies_not_read_back_yet_are_below_n_but_not_below_w() -> None:
    ledger = DurabilityLedger()
    ledger.observe(0, [exposed(1, good=0, unverified=3), exposed(2, good=1, unverified=0)])
    assert (ledger.bytes_below_n, ledger.bytes_below_w) == (200, 100)
    ledger.observe(1000, [exposed(1, good=1, unverified=0)])
    assert (ledger.bytes_below_n, ledger.bytes_below_w) == (100, 100)
    ledger.observe(1500, [])
    debts = {d.segment[1]: (d.below_n_ms, d.below_w_ms) for d in ledger.worst(5)}
    assert debts == {1: (1500, 500), 2: (1000, 1000)}
