"""Structured log lines: logfmt with the segment's fields named the same everywhere."""

from __future__ import annotations

import logging

from streamengine.protocol.logs import LogfmtFormatter, segment_fields


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
