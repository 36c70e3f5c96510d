"""How many calls each principal holds open at once, bounded per principal: the one
counter behind each server's "no single caller takes the whole server" limit (the
store's streaming calls, `segment_store.core.authority.STREAMS_PER_PRINCIPAL_MAX`; the
master's lease holds, `master.core.authority.LEASE_HOLDS_PER_PRINCIPAL_MAX`). Pure.

A server without certificates authenticates nobody: its callers without a token
(INSECURE) are one crowd, not principals, and are neither counted nor refused here. An
anonymous caller is refused before it is counted (by the server, which says why).
"""

from __future__ import annotations

from streamengine.protocol.auth import Principal, PrincipalKind


class OpenCalls:
    """The calls each principal holds open, at most `calls_max` each."""

    def __init__(self, calls_max: int) -> None:
        assert calls_max > 0
        self.calls_max = calls_max
        self._held: dict[Principal, int] = {}

    def open(self, principal: Principal) -> bool:
        """Count a call as it opens; False (nothing counted) when the principal already
        holds `calls_max`."""
        assert principal.kind is not PrincipalKind.ANONYMOUS, "refused before it is counted"
        if principal.kind is PrincipalKind.UNAUTHENTICATED_INSECURE:
            return True
        held = self._held.get(principal, 0)
        if held >= self.calls_max:
            return False
        self._held[principal] = held + 1
        return True

    def close(self, principal: Principal) -> None:
        """The end of a call `open` counted."""
        if principal.kind is PrincipalKind.UNAUTHENTICATED_INSECURE:
            return
        held = self._held[principal]
        assert held > 0
        if held == 1:
            del self._held[principal]
        else:
            self._held[principal] = held - 1

    def held(self, principal: Principal) -> int:
        return self._held.get(principal, 0)
