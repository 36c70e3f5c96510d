"""Backup files of the master's metadata: a round trip keeps every record, a damaged or
truncated file is refused, and a restore writes only into empty metadata."""

from __future__ import annotations

from pathlib import Path

import pytest

from streamengine.client.errors import InvalidArgument
from streamengine.master.metadata import OPS_PER_TRANSACTION_MAX, MemoryMetadata
from streamengine.tools.metadata_backup import read_backup, restore_records, write_backup

RECORDS = [(b"g/" + bytes([n, 0, 255]), b'{"n": %d}' % n) for n in range(250)] + [
    (b"m/next_stream_id", b"\x00" * 7 + b"\x02")
]


def test_a_backup_round_trip_keeps_every_record_byte_for_byte(tmp_path: Path) -> None:
    path = tmp_path / "meta.backup"
    write_backup(sorted(RECORDS), path)
    assert read_backup(path) == sorted(RECORDS)
    assert not path.with_name("meta.backup.partial").exists()


@pytest.mark.parametrize(
    ("damage", "rule"),
    [
        (lambda lines: lines[:-2] + lines[-1:], "a record missing is caught by the count"),
        (lambda lines: lines[:-1], "a file cut short has no end line"),
        (lambda lines: [lines[0], lines[2], lines[1], *lines[3:]], "reordered: checksum"),
        (lambda lines: ["{}", *lines[1:]], "no header"),
    ],
)
def test_a_damaged_backup_is_refused(tmp_path: Path, damage, rule) -> None:
    path = tmp_path / "meta.backup"
    write_backup(sorted(RECORDS), path)
    path.write_text("\n".join(damage(path.read_text().splitlines())) + "\n")
    with pytest.raises(InvalidArgument):
        read_backup(path)
        pytest.fail(rule)


def test_a_restore_fills_empty_metadata_in_bounded_transactions() -> None:
    assert len(RECORDS) > 2 * OPS_PER_TRANSACTION_MAX, "several transactions"
    target = MemoryMetadata()
    restore_records(target, sorted(RECORDS))
    assert target.read_all() == sorted(RECORDS)


def test_a_restore_refuses_metadata_that_holds_records() -> None:
    target = MemoryMetadata([(b"t/acme", b"{}")])
    with pytest.raises(InvalidArgument):
        restore_records(target, sorted(RECORDS))
    assert target.read_all() == [(b"t/acme", b"{}")]


def test_a_restore_can_raise_every_streams_epoch_past_those_granted_since_the_backup(
    tmp_path: Path,
) -> None:
    from dataclasses import replace

    from streamengine.master.catalog import Batch, decode_records
    from streamengine.master.core.model import StreamRecord

    record = StreamRecord("t/s", 1, 3, 2, 1 << 20, 60_000, 7, "w1", 0)
    batch = Batch().tenant("t", 0).stream(record).next_stream_id(2)
    target = MemoryMetadata()
    restore_records(target, sorted(batch.puts), epochs_raised_by=1000)
    assert decode_records(target.read_all()).streams == {"t/s": replace(record, epoch=1007)}
