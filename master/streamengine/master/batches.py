"""Batches of many writers' calls at the master, decided as lone calls would be.

A batch call (`LeaseHeartbeat`, `RollSegments`, `SealSegments`) carries many writers'
requests so that the master commits their changes together. Each entry is still
decided as its lone call would be, as if the entries came one after the other: the
entries of a round name each stream at most once and are decided against the state
the earlier rounds left (`rounds_by_stream`), and a round's changes are committed in
as few metadata transactions as the bound on one allows (`in_transactions`), before
any of them is applied or answered.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

from streamengine.master.core.errors import InvalidArgument, MasterError
from streamengine.master.metadata import OPS_PER_TRANSACTION_MAX
from streamengine.protocol.limits import LEASE_BATCH_ENTRIES_MAX

Entry = TypeVar("Entry")
Item = TypeVar("Item")


def check_batch_size(count: int, what: str) -> None:
    """InvalidArgument for a batch of more than `LEASE_BATCH_ENTRIES_MAX` entries,
    before any entry is looked at: it changes nothing."""
    if count > LEASE_BATCH_ENTRIES_MAX:
        raise InvalidArgument(
            f"{count} {what} in one batch (LEASE_BATCH_ENTRIES_MAX {LEASE_BATCH_ENTRIES_MAX})"
        )


def rounds_by_stream(
    entries: Sequence[Entry | MasterError], stream_of: Callable[[Entry], str]
) -> list[list[tuple[int, Entry]]]:
    """The entries that are not errors already, each with its place in `entries`, in
    rounds that name each stream at most once: a stream's k-th entry goes in round k."""
    rounds: list[list[tuple[int, Entry]]] = []
    seen: dict[str, int] = {}
    for number, entry in enumerate(entries):
        if isinstance(entry, MasterError):
            continue
        stream = stream_of(entry)
        turn = seen.get(stream, 0)
        seen[stream] = turn + 1
        if turn == len(rounds):
            rounds.append([])
        rounds[turn].append((number, entry))
    return rounds


def in_transactions(items: Sequence[Item], ops_of: Callable[[Item], int]) -> list[list[Item]]:
    """`items` in order, in runs that each fit one metadata transaction
    (`OPS_PER_TRANSACTION_MAX` operations: etcd's `--max-txn-ops`), each item whole in
    one."""
    runs: list[list[Item]] = []
    ops = OPS_PER_TRANSACTION_MAX
    for item in items:
        needed = ops_of(item)
        assert 0 < needed <= OPS_PER_TRANSACTION_MAX, needed
        if ops + needed > OPS_PER_TRANSACTION_MAX:
            runs.append([])
            ops = 0
        runs[-1].append(item)
        ops += needed
    return runs
