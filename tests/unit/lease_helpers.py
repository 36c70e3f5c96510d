"""Writers for master-state tests: every grant hands the same lease secret, so a test
names a writer by its client id alone and it proves itself as its holder would."""

from __future__ import annotations

from streamengine.master.core.leadership import Claim
from streamengine.master.state import MasterState
from streamengine.protocol.limits import LEASE_SECRET_BYTES

SECRET = b"s" * LEASE_SECRET_BYTES


def writer(client_id: str) -> Claim:
    """`client_id` showing the secret its grants hand."""
    return Claim(client_id, SECRET)


def fixed_secrets(state: MasterState) -> MasterState:
    """`state`, its grants handing `SECRET`."""
    state.leadership.draw_secret = lambda: SECRET
    return state
