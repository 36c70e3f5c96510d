"""Domain errors of the master, by who is at fault. `master.service_calls` maps each to one
gRPC status in a single table; nothing else in the master knows about gRPC."""

from __future__ import annotations


class MasterError(Exception):
    """Base of every error a master request can end with."""


class InvalidArgument(MasterError):
    """Malformed request: a bad name, an impossible policy, a missing field."""


class NotFound(MasterError):
    """Unknown tenant, stream, segment or store."""


class AlreadyExists(MasterError):
    """A stream exists with another policy."""


class NotLeader(MasterError):
    """The caller does not hold the lease, or its epoch is stale."""


class TooManyUnsealed(MasterError):
    """A roll while two segments are unsealed (invariant 5)."""


class NotEnoughStores(MasterError):
    """Fewer live stores than the policy's replicas."""


class SealConflict(MasterError):
    """A SealSegment contradicting the final index recorded earlier."""


class NotReady(MasterError):
    """Starting or shutting down: retry."""


class PermissionDenied(MasterError):
    """The caller may not make this call: its certificate or token does not allow it,
    its token is invalid, expired or revoked, or it does not hold the epoch it acts
    under."""


class QuotaExceeded(MasterError):
    """The tenant is at one of its quotas (streams)."""


class ResourceExhausted(MasterError):
    """The caller holds all the master gives one caller (calls held open), or a bound
    of the cluster is reached (keys verifying at once)."""


class Unauthenticated(MasterError):
    """The caller's certificate proof does not hold (it must hear why)."""


class NotTrimmable(MasterError):
    """A trim that would take a segment not yet sealed: nothing was trimmed."""


class StreamDeleted(MasterError):
    """The stream is deleted, pending removal: refused until undeleted."""

    def __init__(self, message: str, deleted_until_ms: int):
        self.deleted_until_ms = deleted_until_ms
        super().__init__(message)


class CallerGaveUp(MasterError):
    """The request's deadline passed before the master decided it: its answer would
    reach nobody, so nothing was decided."""


class RebuildUnfinished(MasterError):
    """The metadata holds a rebuild from the stores that stopped halfway: serving it
    would serve a partial catalog."""


class WrongCluster(MasterError):
    """A store keeps another cluster's id: it stops rather than join this one."""
