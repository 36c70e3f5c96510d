"""How long to wait before trying again: one policy for every retry path.

A `Backoff` waits `first_ms` after the first failure and `factor` times longer after
each further one, never longer than `max_ms`; a jittered policy adds up to `jitter_ms`
before the cap, so that the clients of a server that comes back do not all retry in
step. It is pure: the random draw is an input (`jitter_draw`, in [0, 1)), taken by the
shell, or by the simulator from its seed. `tenacity_wait` turns a policy into the
`wait` of a tenacity loop, with the shell's random source.

The policies of the SDK, the stores and the master are named below, each with why its
numbers are what they are; a retry path takes one of them rather than numbers of its own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tenacity import RetryCallState


@dataclass(frozen=True, slots=True)
class Backoff:
    first_ms: int
    max_ms: int
    factor: int = 2
    jitter_ms: int = 0

    def __post_init__(self) -> None:
        assert 0 < self.first_ms <= self.max_ms, (self.first_ms, self.max_ms)
        assert self.factor >= 1 and self.jitter_ms >= 0

    def delay_ms(self, attempt: int, jitter_draw: float | None = None) -> int:
        """The wait after the `attempt`-th failure in a row (1 for the first), with
        `jitter_draw` (in [0, 1)) of the jitter; a jittered policy must be given one."""
        assert attempt >= 1
        assert (jitter_draw is not None) or self.jitter_ms == 0, "a jittered policy draws"
        assert jitter_draw is None or 0.0 <= jitter_draw < 1.0, jitter_draw
        grown = self.first_ms
        # Bounded by the growths to the cap (log(max / first) / log(factor)).
        for _ in range(attempt - 1):
            if grown >= self.max_ms or self.factor == 1:
                break
            grown *= self.factor
        jitter = int(self.jitter_ms * jitter_draw) if jitter_draw is not None else 0
        return min(grown + jitter, self.max_ms)


def tenacity_wait(backoff: Backoff, draw: Callable[[], float]) -> Callable[[RetryCallState], float]:
    """A tenacity `wait` (in seconds) following `backoff`, drawing its jitter from `draw`
    (the shell passes `random.random`)."""

    def wait(state: RetryCallState) -> float:
        return backoff.delay_ms(state.attempt_number, draw()) / 1000

    return wait


# A control call to the master (create, release, seal; `client.retrying`) and the wait
# for a store's channel to connect before the writer opens its Write stream: both fail
# for a moment (a master restarting, a store's connection lost), so they come back quickly
# after a blip and at least once a second; jittered, as every client of a restarted server
# retries at once.
TRANSIENT_CALL = Backoff(first_ms=50, max_ms=1_000, jitter_ms=50)

# A store's Write stream that failed is reopened after this pause, and a segment the
# store refused a request of is routed to it again after it (`client.store_session`,
# and the simulator's writer): quick after a blip, gentle on a store down for a while
# (it is rolled away from after the writer core's STORE_LOST_MS anyway). No jitter: a
# client reopens one stream per store, and gRPC reconnects the channel underneath with
# jitter of its own.
STORE_STREAM_REOPEN = Backoff(first_ms=50, max_ms=1_000)

# A writer leading an epoch granted without a segment asks for a roll again after each
# failure: it takes no appends until one succeeds, so it asks soon (a master that saw
# too few stores for a moment), but stores down for good cost one roll a second. Slower
# to start than STORE_STREAM_REOPEN, as every attempt is a call the master decides on.
ROLL_WITHOUT_SEGMENT = Backoff(first_ms=100, max_ms=1_000)

# A reader's replica that failed, or the master's segment list it could not read, is
# asked again after this (`FollowerTiming`). A reader asks a failed replica only when
# no replica with fewer failures is ready, so the retries cost little; capped at 1 s, as
# a reader whose every replica was down (their stores restarting) reads within a second
# of their return: at 3 s, S16's fresh reader sat 2.7 s on stores that were back.
REPLICA_READ = Backoff(first_ms=100, max_ms=1_000)

# A master's etcd call that failed is tried again (on the next member; `master.election`):
# quick after a blip, quiet (one attempt, and one log line, a second) while etcd is away.
# No jitter: only the few masters of a cluster call.
ETCD_CALL = Backoff(first_ms=100, max_ms=1_000)

# A store registers with the master for as long as it takes (`segment_store.master_link`):
# the whole cluster's stores register with a restarted master at once, so its jitter is
# twice TRANSIENT_CALL's, and a master down for long is asked every two seconds.
STORE_REGISTER = Backoff(first_ms=50, max_ms=2_000, jitter_ms=100)
