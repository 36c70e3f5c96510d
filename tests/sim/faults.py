"""The network's faults a seed draws: loss, duplication, delay and slow messages, as
rates the runtime's transport (`tests/sim/runtime/transport.py`) applies to every call
and byte stream, and `Faults.none()` for the liveness phase."""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Faults:
    """Per-seed fault rates; `Faults.none()` for the liveness phase."""

    loss: float
    duplicate: float
    delay_ms_max: int
    # A few messages take much longer (a stalled connection, a slow GC on the peer).
    slow: float
    slow_delay_ms_max: int

    @staticmethod
    def none() -> Faults:
        return Faults(loss=0.0, duplicate=0.0, delay_ms_max=3, slow=0.0, slow_delay_ms_max=3)

    @staticmethod
    def draw(rng: random.Random) -> Faults:
        return Faults(
            loss=rng.choice((0.0, 0.01, 0.03, 0.08)),
            duplicate=rng.choice((0.0, 0.02, 0.08)),
            delay_ms_max=rng.choice((2, 8, 20)),
            slow=rng.choice((0.0, 0.01, 0.05)),
            slow_delay_ms_max=rng.choice((100, 400, 900)),
        )


# How long an end takes to notice a broken connection (keepalive, RST).
BREAK_DETECTION_MS_MAX = 30
