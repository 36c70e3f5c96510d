"""A store whose disk fills up: writes are refused with a clear status and change
nothing, reads go on, and writes are taken again once space is freed (RocksDB latches
the error: the store reopens it). Needs a small tmpfs, so root."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from streamengine.testing import wait_until
from streamengine.v1 import segment_store_pb2
from tests.integration.store_helpers import (
    entries,
    lone_store,
    read_all,
    seg,
    state,
    store_stub,
    write_all,
    write_request,
)

pytestmark = pytest.mark.timeout(120)

DISK_MB = 160
ROOM_MB = 12  # left free by the filler: what the store fills up


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    mount_point = tmp_path / "disk"
    mount_point.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={DISK_MB}m", "tmpfs", str(mount_point)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)


def fill_disk_but(mount_point: Path, room_mb: int) -> Path:
    filler = mount_point / "filler"
    free_mb = os.statvfs(mount_point).f_bavail * os.statvfs(mount_point).f_frsize >> 20
    with filler.open("wb") as out:
        for _ in range(max(0, free_mb - room_mb)):
            out.write(bytes(1 << 20))
    return filler


async def test_a_full_disk_refuses_writes_keeps_reads_and_recovers_once_freed(
    small_disk: Path,
) -> None:
    with lone_store(small_disk / "cluster") as store:
        filler = fill_disk_but(small_disk, ROOM_MB)
        segment = seg()
        async with store_stub(store) as stub:
            next_index, refusal = 1, None
            for _ in range(10 * ROOM_MB):  # 200 KB a batch: the disk is full long before
                batch = entries(next_index, next_index + 199, size=1000)
                try:
                    await write_all(stub, [write_request(segment, 3, 0, batch)])
                except grpc.RpcError as error:  # a call's end, or its reply's refusal
                    refusal = error
                    break
                next_index += 200
            assert refusal is not None, "the disk never filled up"
            assert refusal.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "No space left on device" in (refusal.details() or "")
            held = next_index - 1
            assert (await state(stub, segment)).matched_index == held
            assert len(await read_all(stub, segment)) == held  # reads go on
            # A delete the store cannot write now gets a status, not UNKNOWN (found by
            # the fault suite's read-only disk, S9b).
            with pytest.raises(grpc.aio.AioRpcError) as delete_refused:
                await stub.Delete(segment_store_pb2.DeleteRequest(segment=segment))
            assert delete_refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED

            filler.unlink()

            async def written_again() -> bool:
                try:
                    replies = await write_all(
                        stub, [write_request(segment, 3, held, entries(held + 1, held + 10))]
                    )
                except grpc.RpcError:
                    return False
                return replies[-1].status == segment_store_pb2.ACCEPTED

            await wait_until(written_again, timeout_s=30, message="writes taken again")
            after = await state(stub, segment)
            assert after.matched_index == held + 10 and after.acked_index == held
            got = await read_all(stub, segment)
            assert [e.index for e in got] == list(range(1, held + 11))
