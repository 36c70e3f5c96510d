"""Which master to call: the list a process is given, and the next one after a failure.

Clients, stores and tools take masters as `a:7070,b:7070` (`--master`,
`$STREAMENGINE_MASTER`, `StreamClient("a:7070,b:7070")`). One of them is active; the
others are standbys that answer UNAVAILABLE and name the active one in the trailing
metadata (`status.ACTIVE_MASTER_METADATA_KEY`) when they know it. `next_master` is the
one rule every caller follows (pure, so the SDK, the stores and the tools cannot
disagree): go where the failed master pointed, else to the next in the list.
"""

from __future__ import annotations

MASTERS_SEPARATOR = ","


class BadMasterList(ValueError):
    pass


def parse_masters(spec: str) -> tuple[str, ...]:
    """`"a:7070, b:7070"` → `("a:7070", "b:7070")`; raises BadMasterList."""
    masters = tuple(part.strip() for part in spec.split(MASTERS_SEPARATOR) if part.strip())
    if not masters:
        raise BadMasterList(f"no master in {spec!r}")
    for master in masters:
        host, colon, port = master.rpartition(":")
        if not colon or not host or not port.isdigit():
            raise BadMasterList(f"master {master!r} must be HOST:PORT")
    if len(set(masters)) != len(masters):
        raise BadMasterList(f"{spec!r} names a master twice")
    return masters


def next_master(masters: tuple[str, ...], failed: str, active_hint: str = "") -> str:
    """The master to call after `failed` answered UNAVAILABLE (naming `active_hint` as
    the active one, or nothing) or did not answer: the one it named, unless that is
    itself; else the one after it in the list (the first if it is not listed)."""
    assert masters, "at least one master"
    if active_hint and active_hint != failed:
        return active_hint
    position = masters.index(failed) if failed in masters else -1
    return masters[(position + 1) % len(masters)]


def attempts_per_call(masters: tuple[str, ...]) -> int:
    """How many masters one call may try before its error goes to the caller: each
    listed one once, plus one hop to an active master a standby named."""
    return len(masters) + 1
