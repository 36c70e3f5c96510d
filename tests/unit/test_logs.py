"""Structured log lines: logfmt with the segment's fields named the same everywhere."""

from __future__ import annotations

import logging
import sys

from grpc._cython import cygrpc  # type: ignore[attr-defined]

from streamengine.protocol.logs import (
    GRPC_CORE_LOGGER,
    LogfmtFormatter,
    PeerGoneAtStatus,
    segment_fields,
)


def formatted(message: str, **extra: object) -> str:
    record = logging.LogRecord("streamengine.store", logging.INFO, __file__, 1, message, (), None)
    for key, value in extra.items():
        setattr(record, key, value)
    return LogfmtFormatter().format(record)


def test_a_segment_line_carries_stream_and_epoch_after_the_message() -> None:
    line = formatted("segment sealed", **segment_fields("acme/orders", 3, fence=4))
    assert line.startswith("ts=") and line.endswith(
        'level=info logger=streamengine.store msg="segment sealed"'
        " stream=acme/orders epoch=3 fence=4"
    )


def test_values_with_spaces_or_quotes_are_quoted_and_escaped() -> None:
    line = formatted('bad "input" here', reason="a b")
    assert 'msg="bad \\"input\\" here"' in line and 'reason="a b"' in line


def test_fields_a_record_does_not_carry_are_left_out() -> None:
    assert "stream=" not in formatted("master serving")


def _record_of(error: BaseException) -> logging.LogRecord:
    try:
        raise error
    except BaseException:
        exc_info = sys.exc_info()
    message = "ExecuteBatchError raised in core by servicer method [%s]"
    call = ("/streamengine.v1.SegmentStore/Write",)
    return logging.LogRecord(GRPC_CORE_LOGGER, logging.ERROR, __file__, 1, message, call, exc_info)


def test_a_status_grpc_could_not_send_to_a_gone_peer_is_one_info_line() -> None:
    """S9 of the fault suite once failed its check of server tracebacks on this record:
    a store's Write call ended as its client was cut off."""
    gone = _record_of(
        cygrpc.ExecuteBatchError(
            'Failed "execute_batch": (<grpc._cython.cygrpc.SendStatusFromServerOperation '
            "object at 0x7f97f3861b10>,)"
        )
    )
    assert PeerGoneAtStatus().filter(gone)
    line = LogfmtFormatter().format(gone)
    assert "level=info" in line and "exception=" not in line
    assert "SegmentStore/Write" in line and "peer is gone" in line
    # Any other failure of grpc's core keeps its level and traceback.
    other = _record_of(cygrpc.ExecuteBatchError('Failed "execute_batch": (SendMessageOperation,)'))
    assert PeerGoneAtStatus().filter(other)
    assert "level=error" in LogfmtFormatter().format(other)
    assert "exception=" in LogfmtFormatter().format(other)
