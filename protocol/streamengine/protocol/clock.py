"""The two clocks every process reads, under different names.

- `monotonic_ms()`: deadlines, timeouts, rates, and every `now_ms` a core is given.
  It never goes back, and means nothing in another process or after a restart.
- `wall_ms()`: what outlives a process or crosses machines: token, grant and proof
  expiry, segment ages for retention, the time a keepalive was sent.

Cores never read either: time is an input (tests/test_layering.py).
"""

from __future__ import annotations

import time


def monotonic_ms() -> int:
    return time.monotonic_ns() // 1_000_000


def wall_ms() -> int:
    return time.time_ns() // 1_000_000
