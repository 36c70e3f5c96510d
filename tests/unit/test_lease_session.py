"""The lease session hands each writer its own entry's answer, or its own refusal as the
error `WriterHeartbeat` would have raised (`client.leases`)."""

from __future__ import annotations

import grpc

from streamengine.client.core.writer import STREAM_DELETED, heartbeat_failure_policy
from streamengine.client.errors import NotFound, StreamDeleted, from_rpc_error
from streamengine.client.leases import refusal
from streamengine.v1 import master_pb2


def test_an_entry_refused_alone_is_the_error_its_writer_would_have_got_alone() -> None:
    deleted = refusal(
        master_pb2.LeaseHeartbeatAnswer(
            code=grpc.StatusCode.FAILED_PRECONDITION.value[0],
            message="stream 't/s' is deleted",
            deleted_until_ms=1234,
        )
    )
    error = from_rpc_error(deleted)
    assert isinstance(error, StreamDeleted) and error.deleted_until_ms == 1234
    assert heartbeat_failure_policy(STREAM_DELETED).ends_leading

    unknown = refusal(
        master_pb2.LeaseHeartbeatAnswer(code=grpc.StatusCode.NOT_FOUND.value[0], message="no")
    )
    assert unknown.code() is grpc.StatusCode.NOT_FOUND and unknown.details() == "no"
    assert isinstance(from_rpc_error(unknown), NotFound)
    assert heartbeat_failure_policy(unknown.code().name).ends_following
