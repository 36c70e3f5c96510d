"""What a plan of the store's commands wrote so far, overlaid on the published state
(`core.writes.plan`): a later command of the same plan reads it as it reads the KV.

An append's run is kept as the columns it came in (epochs, kinds, sizes, values), and a
tuple is made only for an index a later command asks for: building one per index was
the largest line of a store's batched writes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

# (epoch, kind, payload size, stored value) of one copy.
Held = tuple[int, int, int, bytes]


@dataclass(slots=True)
class Run:
    """Copies of consecutive indexes from `first` a plan appended, kept as the columns
    they came in: an append's run is looked at again only by a later command of the
    same plan, so no tuple is made per index unless one is."""

    first: int
    epochs: Sequence[int]
    kinds: Sequence[int]
    sizes: Sequence[int]
    values: Sequence[bytes]

    def held(self, index: int) -> Held | None:
        position = index - self.first
        if not 0 <= position < len(self.values):
            return None
        return (
            self.epochs[position],
            self.kinds[position],
            self.sizes[position],
            self.values[position],
        )

    def cut_after(self, final: int) -> dict[int, int]:
        """Drop the copies past index `final`; their payload sizes, by index."""
        keep = max(0, final + 1 - self.first)
        dropped = dict(enumerate(self.sizes[keep:], self.first + keep))
        self.epochs, self.kinds = self.epochs[:keep], self.kinds[:keep]
        self.sizes, self.values = self.sizes[:keep], self.values[:keep]
        return dropped


@dataclass(slots=True)
class Written:
    """The copies a plan wrote to one segment: runs appended past everything held
    (disjoint, as each starts past the last index), and single copies, which win over
    a run's at their index (written later, over what was held)."""

    copies: dict[int, Held] = field(default_factory=dict)
    runs: list[Run] = field(default_factory=list)

    def held(self, index: int) -> Held | None:
        found = self.copies.get(index)
        if found is not None:
            return found
        for run in self.runs:
            found = run.held(index)
            if found is not None:
                return found
        return None

    def cut_after(self, final: int) -> dict[int, int]:
        """Drop the copies past index `final`; their payload sizes, by index."""
        dropped: dict[int, int] = {}
        for run in self.runs:
            dropped.update(run.cut_after(final))
        for index in [i for i in self.copies if i > final]:
            dropped[index] = self.copies.pop(index)[2]
        return dropped
