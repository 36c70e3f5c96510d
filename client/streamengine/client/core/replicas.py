"""Which replica a reader asks next for one segment, when it waits, and when a range is
lost: one rule for followers (`core.subscription`) and Spark partitions (`client.spark`).

Theory of operation. A reader needs the indexes from `next_index` on, from any replica
of the segment's copy set (the master's list). What it learns about a replica is one of
two kinds:

- an *answer*: the replica told what it holds (its acked index, from a Subscribe
  POSITION, the entries it served, or NOT_FOUND, which is an acked index of 0). An
  answer is a fact about that store's disk.
- a *failure*: the replica could not be asked (unreachable, timed out, silent, the
  stream broke). A failure says nothing about what the store holds: a store that is
  restarting, paused or cut off fails and then comes back with everything it had.
- *damage*: the replica answered, but what it holds from some index on cannot be served:
  the store failed the read with DATA_LOSS (a copy or a block failed its checksum), an
  entry it sent failed its crc32c, or a chunk it sent differs from the segment's
  certificate (`streamengine.protocol.certificate`), or the master lists it as differing from the
  certificate. Damage is an answer, and it sticks: nothing the replica says later makes
  it a source of that range again for this reader (C14: a reader whose every replica is
  damaged raises `DataLossError` instead of waiting for ever).

A failed replica is retried after a backoff that grows with each consecutive failure
(`FollowerTiming.replica_backoff`); any answer resets it.

Data loss (`Lost`) is declared for a *sealed* segment only, and only when no replica can
hold the range:
1. the master lists no replica for the segment; or
2. every replica the master lists has answered since the reader learned that the
   segment is sealed (`segment_sealed`: an answer about an open segment says nothing
   about its end), its latest answer is an acked index below `next_index` (including
   NOT_FOUND), and the master's list was fetched again after the last of those answers
   (`list_refreshed`) and still names only them: a repair may have moved the segment
   to other stores meanwhile, and the old ones may have dropped it.
A store's acked index covers only entries it holds final, and once the master lists a
segment sealed at least W stores held it to the bridge; a repair copies only from a
replica that reached the bridge, and verifies the copy against the certificate. So when
every listed replica says it holds less, or is damaged there, no store of the cluster
can serve the range. A failure never counts toward data loss, and
neither does an open segment: its replicas' acked indexes may still grow.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from streamengine.protocol.backoff import REPLICA_READ, Backoff


@dataclass(frozen=True, slots=True)
class FollowerTiming:
    """Every wait of a reader, in one place: the SDK uses the defaults; tests that
    want a run short pass `FollowerTiming.fast()`."""

    # Backoff of a failed replica, and of the master's list that could not be read.
    replica_backoff: Backoff = REPLICA_READ
    # A replica that serves nothing new for this long while the master says its segment
    # is sealed beyond what it served has missed the bridge: try another one.
    sealed_replica_stall_ms: int = 2000
    # A replica that serves nothing for this long while its segment is open may have
    # been left behind by the leader (detached): read the next one (an idle stream's
    # reader only rotates).
    open_replica_stall_ms: int = 5000
    # With nothing listed at the position, re-read the master's list this often.
    idle_refresh_ms: int = 200
    # While tailing, re-read the master's list this often: the segment may have been
    # sealed (a new leader) and the replica may never reach its bridge.
    segment_refresh_ms: int = 1000
    # The keepalive interval a subscriber promises (and asks of the store), and how long
    # a replica may stay silent (no entries, position or keepalive) before it is left:
    # a few intervals, so one late keepalive is not a failure.
    keepalive_interval_ms: int = 1000
    silent_replica_ms: int = 4000
    # How long an answer from the master (the segment list) may take.
    list_timeout_ms: int = 5000
    # A bounded read (`read`, `read_batches`, `tail` without --follow, a Spark
    # partition) whose position has not moved for this long while every replica that
    # may serve it keeps failing raises Unavailable naming them: it promises every
    # acked event of its range or an error, and cannot wait for ever. Longer than a
    # store's restart (a few seconds) and than the longest backoff, so a store coming
    # back is read; a subscription never gives up.
    unreachable_read_ms: int = 10_000

    def __post_init__(self) -> None:
        assert self.sealed_replica_stall_ms > 0 and self.idle_refresh_ms > 0
        assert self.open_replica_stall_ms > self.segment_refresh_ms
        assert self.segment_refresh_ms > 0 and self.keepalive_interval_ms > 0
        assert self.silent_replica_ms > 2 * self.keepalive_interval_ms
        assert self.list_timeout_ms > 0
        assert self.unreachable_read_ms > self.unreachable_read_ms_floor

    @property
    def unreachable_read_ms_floor(self) -> int:
        """A bounded read gives up later than this: past the longest backoff and the
        silence that marks a replica unreachable, so each replica was asked again."""
        return max(self.replica_backoff.max_ms, self.silent_replica_ms)

    def giving_up_after(self, unreachable_read_ms: int) -> FollowerTiming:
        """These waits with a bounded read's own give-up time (the reader's choice:
        `read(..., give_up_after_s=)`, `tail --give-up-after`); ValueError at or below
        `unreachable_read_ms_floor`."""
        if unreachable_read_ms <= self.unreachable_read_ms_floor:
            raise ValueError(
                f"a bounded read gives up after more than "
                f"{self.unreachable_read_ms_floor / 1000:g} s (the silence that marks a "
                f"replica unreachable), not {unreachable_read_ms / 1000:g} s"
            )
        return replace(self, unreachable_read_ms=unreachable_read_ms)

    @staticmethod
    def fast() -> FollowerTiming:
        """The same protocol with waits a run of a few seconds goes through many times
        (tests that want a reader to ask again soon)."""
        return FollowerTiming(
            replica_backoff=Backoff(first_ms=20, max_ms=400),
            sealed_replica_stall_ms=300,
            open_replica_stall_ms=600,
            idle_refresh_ms=50,
            segment_refresh_ms=150,
            keepalive_interval_ms=50,
            silent_replica_ms=200,
            list_timeout_ms=200,
            unreachable_read_ms=800,
        )

    def retry_delay_ms(self, failures: int) -> int:
        """The backoff after `failures` consecutive failures (1 for the first), of a
        replica or of the master's list."""
        return self.replica_backoff.delay_ms(failures)


@dataclass(frozen=True, slots=True)
class Ask:
    """Read from `replica` now."""

    replica: str


@dataclass(frozen=True, slots=True)
class WaitUntil:
    """No replica can be asked before `until_ms`."""

    until_ms: int


@dataclass(frozen=True, slots=True)
class Relist:
    """Every listed replica says it holds less: re-read the master's list (then
    `list_refreshed`) and ask again, before calling it lost."""


@dataclass(frozen=True, slots=True)
class Lost:
    """No replica of the sealed segment can hold `next_index` on (rules in the module
    docstring)."""


Choice = Ask | WaitUntil | Relist | Lost


@dataclass(slots=True)
class _Replica:
    acked: int | None = None  # its latest answer; None: it never answered
    answered_in: int = -1  # the list generation its latest answer came in
    failures: int = 0  # consecutive failures since its latest answer
    retry_at_ms: int = 0
    damaged_from: int | None = None  # it cannot serve from this index on (sticky)
    passed_over_ms: int = 0  # when a reader last left it for serving nothing (0: never)


@dataclass
class ReplicaSet:
    """What one reader knows about the replicas of one segment."""

    timing: FollowerTiming = field(default_factory=FollowerTiming)
    _replicas: dict[str, _Replica] = field(default_factory=dict)
    _list_generation: int = 0
    _sealed: bool = False

    # ---- inputs ----

    def list_refreshed(self) -> None:
        """The master's list was fetched again (the replicas passed to `choose` are its)."""
        self._list_generation += 1

    def segment_sealed(self) -> None:
        """The master lists the segment sealed: forget what replicas said while it was
        open (their acked indexes may have grown since)."""
        if not self._sealed:
            self._sealed = True
            for state in self._replicas.values():
                if state.damaged_from is None:  # damage is about the disk: it stays
                    state.acked = None
                    state.answered_in = -1

    def answered(self, replica: str, acked_index: int) -> None:
        """`replica` says it serves up to `acked_index` (0: it does not hold the segment)."""
        assert acked_index >= 0
        state = self._of(replica)
        state.acked = acked_index
        state.answered_in = self._list_generation
        state.failures = 0
        state.retry_at_ms = 0

    def served(self, replica: str, last_index: int) -> None:
        """`replica` served entries up to `last_index`: it holds at least those, acked.
        A lower bound, never an answer about where it ends: entries a store sent while
        the segment was open can arrive after the reader learned it is sealed (a slow
        stream), when the store already holds more. Taking them for an answer once made
        a reader declare data loss on a replica holding the whole segment (simulator
        seed 153)."""
        state = self._of(replica)
        state.failures = 0
        state.retry_at_ms = 0
        if state.acked is not None and state.acked < last_index:
            state.acked = last_index

    def damaged(self, replica: str, index: int) -> None:
        """`replica` cannot serve `index` and what follows (module docstring)."""
        assert index >= 1
        state = self._of(replica)
        if state.damaged_from is not None and state.damaged_from <= index:
            return  # known already: no newer answer than the one that said so
        state.damaged_from = index
        state.answered_in = self._list_generation
        state.failures = 0
        state.retry_at_ms = 0

    def failed(self, replica: str, now_ms: int) -> None:
        """`replica` could not be asked; it may be back later."""
        state = self._of(replica)
        state.failures += 1
        state.retry_at_ms = now_ms + self.timing.retry_delay_ms(state.failures)

    def passed_over(self, replica: str, now_ms: int) -> None:
        """`replica` served nothing for a while on an open segment: not a failure (it
        answers), but the others come first now, the longest passed over next."""
        self._of(replica).passed_over_ms = now_ms

    # ---- decisions ----

    def below(self, replica: str, next_index: int) -> bool:
        """Its latest answer says it cannot serve `next_index`."""
        state = self._replicas.get(replica)
        if state is None:
            return False
        if state.damaged_from is not None and state.damaged_from <= next_index:
            return True
        return state.acked is not None and state.acked < next_index

    def unreachable(self, replicas: tuple[str, ...], sealed: bool, next_index: int) -> bool:
        """Every replica that may serve `next_index` failed since its latest answer."""
        hopeful = [r for r in replicas if not (sealed and self.below(r, next_index))]
        failing = [r for r in hopeful if r in self._replicas and self._replicas[r].failures]
        return bool(hopeful) and failing == hopeful

    def choose(
        self, replicas: tuple[str, ...], sealed: bool, next_index: int, now_ms: int
    ) -> Choice:
        """The replica to read `next_index` on from, or how long to wait, or `Lost`.
        Among those that may serve, one known to serve the index comes first, then the
        master's order (which spreads readers as copy sets are spread)."""
        assert self._sealed or not sealed, "segment_sealed() first"
        if sealed and not replicas:
            return Lost()
        hopeful = [r for r in replicas if not (sealed and self.below(r, next_index))]
        if not hopeful:
            assert sealed
            newest_answer = max(self._replicas[r].answered_in for r in replicas)
            return Lost() if newest_answer < self._list_generation else Relist()
        ready = [r for r in hopeful if self._of(r).retry_at_ms <= now_ms]
        if not ready:
            return WaitUntil(min(self._replicas[r].retry_at_ms for r in hopeful))
        # One never passed over first, then the one passed over longest ago: a replica
        # that answers while serving nothing (a wiped store's NOT_FOUND for an open
        # segment, which clears its failures) must not win over replicas whose failures
        # date from before, or the reader tails it for good while they serve on
        # (runtime seed 58). Then the fewest failures (else, with every replica failing,
        # the first two could take turns for ever and the third never be asked);
        # stable: the master's order.
        ready.sort(key=lambda r: (self._of(r).passed_over_ms, self._of(r).failures))
        serving = [r for r in ready if (self._of(r).acked or 0) >= next_index]
        return Ask((serving or ready)[0])

    # ---- internals ----

    def _of(self, replica: str) -> _Replica:
        state = self._replicas.get(replica)
        if state is None:
            state = self._replicas[replica] = _Replica()
        return state
