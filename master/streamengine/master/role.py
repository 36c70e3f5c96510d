"""Whether this master process is the active master now, and if so with which state.

With the embedded metadata a master is active from the moment its catalog is loaded
until it stops. With etcd, the election (`master.election`) makes it active when it wins
and takes it back when it loses; in between it counts its own election lease as a
writer counts its lease (`leadership.master_active_until`): from the send time of the
last keepalive etcd confirmed, so that it stops serving before etcd can expire the lease
and let a standby win. Every request checks `serving(now_ms)` first, in the same
synchronous step as the state change it makes, so a master paused past its lease (a
SIGSTOP, a long GC pause) refuses the first request it handles after it wakes.
"""

from __future__ import annotations

from streamengine.master.metadata import NotActive
from streamengine.master.repair import Repairer
from streamengine.master.state import MasterState
from streamengine.protocol import identity

# An active master whose lease never runs out (the embedded metadata: one master).
FOREVER_MS = 1 << 62


class MasterRole:
    def __init__(self, address: str) -> None:
        self.address = address
        self.state: MasterState | None = None
        self.repairer: Repairer | None = None
        self.active_until_ms = 0
        # The active master as the election last reported it ("" unknown): what a standby
        # tells callers to try instead.
        self.active_address = ""

    def activate(self, state: MasterState, repairer: Repairer, until_ms: int = 0) -> None:
        self.state, self.repairer = state, repairer
        # The certificates this state's metadata revoked are refused from now on.
        identity.take_revocations(state.cert_revocations)
        if until_ms:
            self.active_until_ms = until_ms
        self.active_address = self.address

    def step_down(self) -> None:
        self.state, self.repairer = None, None
        if self.active_address == self.address:
            self.active_address = ""

    def confirmed(self, until_ms: int) -> None:
        """The election lease runs at least until `until_ms` (a keepalive answered)."""
        self.active_until_ms = max(self.active_until_ms, until_ms)

    def lease_lost(self) -> None:
        """etcd says the election lease is gone: nothing it confirmed counts any more."""
        self.step_down()
        self.active_until_ms = 0

    def serving(self, now_ms: int) -> MasterState:
        """The state to answer from, or NotActive naming the active master if known."""
        if self.state is None:
            raise NotActive("this master is a standby", self._elsewhere())
        if now_ms >= self.active_until_ms:
            raise NotActive(
                "this master cannot confirm it is still the active one (etcd unreachable?)"
            )
        return self.state

    def _elsewhere(self) -> str:
        return "" if self.active_address == self.address else self.active_address
