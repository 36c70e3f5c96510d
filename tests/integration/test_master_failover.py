"""Several masters on etcd, against real processes: the active master SIGKILLed or paused
under a writer, etcd restarted under load, a three-member etcd losing a member.

Writers run as processes of their own (`bench.append_writer`, what they acked is what
they printed); everything is read back through the SDK afterwards and every acked
append must be there exactly once, in order. Timings are measured, never slept: a
standby must be the active master within `FAILOVER_S_MAX` of the active one's death.

A leader rides out a master that does not answer (it keeps appending to its open
segment and renews when one answers): under a SIGKILL of the active master not one
append fails. Where a test lets a writer end (etcd restarted, a member lost), `Load`
starts the next one as an application would, and checks the first ended honestly.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from streamengine.client import StreamClient
from streamengine.etcd import rpc_pb2, rpc_pb2_grpc
from streamengine.master.etcd import EtcdTLS, parse_etcd_url
from streamengine.master.metadata import prefix_end
from streamengine.protocol.status import ACTIVE_MASTER_METADATA_KEY
from streamengine.testing import (
    Cluster,
    EtcdCluster,
    etcd_answers,
    etcd_binary,
    is_active_master,
    running_etcd,
    running_ha_cluster,
    wait_until,
)
from streamengine.tools.certs import create_local_certs
from streamengine.v1 import entry_pb2, master_pb2, master_pb2_grpc
from tests.integration.test_cli import run_cli
from tests.integration.writer_process import WriterProcess, numbers_of, read_all

pytestmark = pytest.mark.skipif(
    etcd_binary() is None,
    reason="etcd is not installed (deploy/install-system-deps.sh installs Debian's etcd-server)",
)

# Issue #15: a standby is active within 2 s of the active master's death.
FAILOVER_S_MAX = 2.0
# Errors a writer may end with (it lost its epoch, or its appends waited too long):
# honest ones, each saying whether the append may still appear.
HONEST_ENDINGS = {
    "LeadershipLost",
    "Fenced",
    "AppendFailed",
    "AppendInDoubt",
    "AppendTimedOut",
    "Unavailable",
}
BATCHES_MAX = 2000  # bounds every writer process (10 events a batch)


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdCluster]:
    """One etcd member for the tests that do not restart it; each test its own prefix."""
    with running_etcd(tmp_path_factory.mktemp("etcd")) as running:
        yield running


class Load:
    """A stream written by one writer process after another: when one ends (its lease
    ran out while no master answered), the next starts, as an application would."""

    def __init__(self, cluster: Cluster, stream: str, writers: list[WriterProcess]) -> None:
        self.cluster = cluster
        self.stream = stream
        self.writers = writers
        self.prefixes: list[str] = []
        self.start()

    @property
    def current(self) -> WriterProcess:
        return self.writers[-1]

    def start(self) -> None:
        prefix = f"w{len(self.prefixes)}"
        self.prefixes.append(prefix)
        writer = WriterProcess(self.cluster.master_address, self.stream, prefix, BATCHES_MAX)
        self.writers.append(writer)

    def keep_writing(self) -> None:
        """Start the next writer if the current one ended with an honest error."""
        ended = self.current.first("error")
        if ended is not None:
            assert ended["error"] in HONEST_ENDINGS, ended
            self.start()

    def acked(self) -> int:
        return sum(w.last_acked() + 1 for w in self.writers)

    def failed(self) -> list[str]:
        return [line["error"] for w in self.writers if (line := w.first("error"))]

    async def wait_acked(self, count: int, timeout_s: float, why: str) -> None:
        def enough() -> bool:
            self.keep_writing()
            return self.acked() >= count

        await wait_until(enough, timeout_s, why)

    def stop(self) -> None:
        for writer in self.writers:
            writer.kill()


async def check_every_acked_append_once(client: StreamClient, load: Load) -> list[int]:
    """Seal the stream, then read it back: each writer's acked appends are there once and
    in order (its in-doubt ones after them at most once); returns the epochs of the
    segments. Sealing first recovers the segment the last (killed) writer left open: the
    stores learn an acked index with the writer's next write, so reading an open segment
    up to what they serve can end a batch or two before what the writer acked."""
    await client.seal(load.stream)
    events = await read_all(client, load.stream)
    sequences = [sequence for sequence, _ in events]
    assert sequences == sorted(set(sequences)), "sequences strictly increase"
    for writer in load.writers:
        numbers = numbers_of(events, writer.prefix)
        assert numbers == list(range(len(numbers))), f"{writer.prefix}: order, gap or repeat"
        assert len(numbers) >= writer.last_acked() + 1, f"{writer.prefix}: an acked append lost"
    epochs = [segment.epoch for segment in await client.list_segments(load.stream)]
    assert epochs == sorted(set(epochs)), "epochs strictly increase"
    return epochs


async def wait_failover(cluster: Cluster, old: str) -> tuple[str, float]:
    """Measure how long after now another master says it is the active one."""
    started = time.monotonic()

    def other_active() -> str | None:
        active = cluster.active_master()
        return active.address if active is not None and active.address != old else None

    await wait_until(other_active, 10, "a standby becoming active", interval_s=0.01)
    elapsed = time.monotonic() - started
    active = other_active()
    assert active is not None
    return active, elapsed


async def test_sigkill_of_the_active_master_under_a_writer_fails_over_within_2_s(
    etcd: EtcdCluster, tmp_path: Path, writers: list[WriterProcess]
) -> None:
    with running_ha_cluster(tmp_path, etcd, masters=2, prefix="kill") as cluster:
        stream = "ha/kill"
        async with StreamClient(cluster.master_address) as client:
            await client.create_stream(stream, replicas=3, write_quorum=2)
            load = Load(cluster, stream, writers)
            await load.wait_acked(300, 30, "300 acked appends")
            first_epoch = load.current.leading_epoch()

            old = cluster.master
            old.kill()
            active, failover_s = await wait_failover(cluster, old.address)
            print(f"standby active {failover_s:.2f} s after the SIGKILL")
            assert failover_s <= FAILOVER_S_MAX, f"standby active {failover_s:.2f} s after"

            # Appends go on through the new master (the same writer, or the next one).
            acked_at_failover = load.acked()
            await load.wait_acked(acked_at_failover + 300, 30, "appends after the failover")

            # A second writer takes the stream over from the first.
            load.current.signal(signal.SIGKILL)
            load.current.kill()
            second = WriterProcess(cluster.master_address, stream, "takeover", batches=5)
            writers.append(second)
            load.prefixes.append("takeover")
            await wait_until(lambda: second.process.poll() is not None, 30, "takeover")
            assert second.first("done"), second.lines
            takeover_epoch = second.leading_epoch()
            assert takeover_epoch > first_epoch
            load.stop()

            epochs = await check_every_acked_append_once(client, load)
            assert epochs[-1] >= takeover_epoch and first_epoch in epochs
            # The writer rode the failover out: not one append failed, no restart.
            assert load.failed() == [] and load.prefixes == ["w0", "takeover"]
        assert cluster.active_master() is not None
        assert cluster.active_master().address == active  # type: ignore[union-attr]


async def test_a_paused_active_master_wakes_up_deposed_and_grants_and_writes_nothing(
    etcd: EtcdCluster, tmp_path: Path
) -> None:
    with running_ha_cluster(tmp_path, etcd, masters=2, prefix="pause") as cluster:
        async with StreamClient(cluster.master_address) as client:
            await client.create_stream("ha/led", replicas=3, write_quorum=2)
            await client.create_stream("ha/free", replicas=3, write_quorum=2)
            async with client.writer("ha/led") as writer:
                await writer.append_batch([b"before"] * 10)
                epoch_before = writer.epoch

            old = cluster.master
            channel = grpc.aio.insecure_channel(old.address)
            stub = master_pb2_grpc.MasterStub(channel)
            # One answered call first: the connection exists, so what is sent while the
            # master is stopped waits in its socket and is handled as it wakes.
            await stub.DescribeStream(master_pb2.DescribeStreamRequest(name="ha/free"), timeout=5)
            old.stop()
            try:
                grant = asyncio.ensure_future(
                    stub.WriterHeartbeat(
                        master_pb2.WriterHeartbeatRequest(stream="ha/free", client_id="ghost"),
                        timeout=30,
                    )
                )
                create = asyncio.ensure_future(
                    stub.CreateStream(
                        master_pb2.CreateStreamRequest(
                            name="ha/ghost",
                            policy=entry_pb2.ReplicationPolicy(replicas=3, write_quorum=2),
                        ),
                        timeout=30,
                    )
                )
                new, failover_s = await wait_failover(cluster, old.address)
                assert failover_s <= FAILOVER_S_MAX + 0.5, "a paused master is found dead too"

                # The new master grants (after its restart rule) and writes.
                async with client.writer("ha/led", leadership_timeout_s=15) as writer:
                    await writer.append_batch([b"after"] * 10)
                    epoch_after = writer.epoch
                assert epoch_after > epoch_before
            finally:
                old.cont()

            for call in (grant, create):
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await call
                assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, refused.value
            # Once a standby, it names the active master.
            await wait_until(
                lambda: old.log().count("election lease lost") > 0, 10, "the old master deposed"
            )
            assert not is_active_master(old.address)
            async def names_the_new_master() -> bool:
                try:
                    await stub.DescribeStream(
                        master_pb2.DescribeStreamRequest(name="ha/free"), timeout=5
                    )
                except grpc.aio.AioRpcError as standby:
                    assert standby.code() == grpc.StatusCode.UNAVAILABLE, standby
                    hints = dict(standby.trailing_metadata() or ())
                    return hints.get(ACTIVE_MASTER_METADATA_KEY) == new
                raise AssertionError("the old master answered after its lease was gone")

            # Once it read the election (every 100 ms), the standby names the active one.
            await wait_until(names_the_new_master, 10, "the old master naming the new one")
            await channel.close()

            # Nothing the old master was asked after its pause reached the metadata.
            assert (await client.describe_stream("ha/free")).epoch == 0
            listed = await client.master.ListStreams(master_pb2.ListStreamsRequest(), timeout=5)
            names = {s.name for s in listed.streams}
            assert "ha/ghost" not in names
            assert (await client.describe_stream("ha/led")).epoch == epoch_after


async def test_etcd_restarted_under_load_loses_no_acked_append(
    tmp_path: Path, writers: list[WriterProcess]
) -> None:
    with (
        running_etcd(tmp_path / "etcd") as etcd,
        running_ha_cluster(tmp_path, etcd, masters=2) as cluster,
    ):
        stream = "ha/etcd-restart"
        async with StreamClient(cluster.master_address) as client:
            await client.create_stream(stream, replicas=3, write_quorum=2)
            load = Load(cluster, stream, writers)
            await load.wait_acked(300, 30, "300 acked appends")

            etcd.members[0].restart()
            etcd.wait_ready()
            await wait_until(lambda: cluster.active_master() is not None, 20, "an active master")
            acked = load.acked()
            await load.wait_acked(acked + 300, 30, "appends after etcd came back")
            load.stop()
            await check_every_acked_append_once(client, load)
            # Metadata writes work again: a new stream, granted to a new writer.
            await client.create_stream("ha/after-restart", replicas=3, write_quorum=2)
            async with client.writer("ha/after-restart", leadership_timeout_s=15) as writer:
                await writer.append(b"x")
        assert all(master.alive() for master in cluster.masters), "no master exits for it"


async def test_a_three_member_etcd_losing_a_member_keeps_masters_and_writers_going(
    tmp_path: Path, writers: list[WriterProcess]
) -> None:
    with (
        running_etcd(tmp_path / "etcd", members=3) as etcd,
        running_ha_cluster(tmp_path, etcd, masters=2) as cluster,
    ):
        stream = "ha/three"
        async with StreamClient(cluster.master_address) as client:
            await client.create_stream(stream, replicas=3, write_quorum=2)
            load = Load(cluster, stream, writers)
            await load.wait_acked(300, 30, "300 acked appends")

            # The member every master calls first.
            etcd.members[0].kill()
            acked = load.acked()
            await load.wait_acked(acked + 300, 30, "appends with two etcd members")
            await client.create_stream("ha/three-after", replicas=3, write_quorum=2)
            async with client.writer("ha/three-after", leadership_timeout_s=15) as writer:
                await writer.append(b"x")
            load.stop()
            await check_every_acked_append_once(client, load)
        assert cluster.active_master() is not None


async def test_an_active_master_whose_election_key_vanishes_steps_down_at_once(
    etcd: EtcdCluster, tmp_path: Path
) -> None:
    """Its keepalives still work: it learns from the election that another master won
    (not at its next commit), and joins the election again as a standby."""
    with running_ha_cluster(tmp_path, etcd, masters=2, stores=0, prefix="vanish") as cluster:
        old = cluster.master
        election = parse_etcd_url(etcd.url("vanish")).election_name + b"/"
        with grpc.insecure_channel(etcd.endpoints[0]) as channel:
            kv = rpc_pb2_grpc.KVStub(channel)
            oldest = kv.Range(
                rpc_pb2.RangeRequest(
                    key=election,
                    range_end=prefix_end(election),
                    sort_target=rpc_pb2.RangeRequest.CREATE,
                    sort_order=rpc_pb2.RangeRequest.ASCEND,
                    limit=1,
                ),
                timeout=5,
            ).kvs[0]
            assert oldest.value.decode() == old.address, "the oldest key is the active master's"
            kv.DeleteRange(rpc_pb2.DeleteRangeRequest(key=oldest.key), timeout=5)
        new, _ = await wait_failover(cluster, old.address)
        await wait_until(lambda: "deposed" in old.log(), 10, "the old master deposed")
        assert not is_active_master(old.address) and old.alive()
        assert new == cluster.standbys[0].address


async def test_clients_stores_and_tools_given_a_standby_first_reach_the_active_master(
    etcd: EtcdCluster, tmp_path: Path
) -> None:
    with running_ha_cluster(tmp_path, etcd, masters=2, stores=1, prefix="list") as cluster:
        standby, active = cluster.standbys[0].address, cluster.master.address
        masters = f"{standby},{active}"
        created = run_cli(
            "stream",
            "create",
            "ha/listed",
            "--replicas",
            "1",
            "--write-quorum",
            "1",
            env={"STREAMENGINE_MASTER": masters},
        )
        assert created.returncode == 0, created.stderr
        status = run_cli("status", "--json", "--master", masters)
        assert status.returncode == 0, status.stderr
        # The store was given both masters too: it registered with the active one.
        assert [s["alive"] for s in json.loads(status.stdout)["stores"]] == [True]
        async with StreamClient(masters) as client:
            async with client.writer("ha/listed") as writer:
                await writer.append(b"through the standby's hint")
            assert (await client.describe_stream("ha/listed")).epoch == 1
        # A standby refuses every call with UNAVAILABLE, whatever the reply it would
        # build (SealSegment raised AssertionError there, in a fault run's failover).
        async with grpc.aio.insecure_channel(standby) as channel:
            stub = master_pb2_grpc.MasterStub(channel)
            seal = stub.SealSegment(master_pb2.SealSegmentRequest(stream="ha/listed"), timeout=5)
            listing = stub.ListSegments(master_pb2.ListSegmentsRequest(stream="ha/listed"))
            for call in (seal, listing):
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await call
                assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, refused.value
        bad = run_cli("status", "--master", "nowhere")
        assert bad.returncode == 1 and "HOST:PORT" in bad.stderr and "Traceback" not in bad.stderr


async def test_masters_on_a_tls_etcd_fail_over_and_etcd_refuses_other_clients(
    tmp_path: Path,
) -> None:
    """etcd with TLS, client certificates (its own member certificate from the cluster's
    CA) and its auth enabled as `metadata secure` does: the masters reach it with their
    node certificates and elect, fail over and serve as on a plaintext one; a plaintext
    client, and one with another CA's certificate, get nothing from etcd; `metadata
    backup` reaches it with etcd's root certificate in the admin's certs dir."""
    certs = create_local_certs(tmp_path / "certs")
    with (
        running_etcd(tmp_path / "etcd", certs=certs) as etcd,
        running_ha_cluster(tmp_path, etcd, masters=2, certs=certs) as cluster,
    ):
        assert etcd.tls is not None
        endpoint = etcd.endpoints[0]
        assert etcd_answers(endpoint, tls=etcd.tls)
        assert not etcd_answers(endpoint)  # plaintext
        other = create_local_certs(tmp_path / "other-ca")
        other.add_etcd_root()
        assert not etcd_answers(endpoint, tls=EtcdTLS.from_certs_dir(other.client_dir))

        stream = "ha/tls"
        admin = cluster.admin_certs_dir
        async with StreamClient(cluster.master_address, certs_dir=admin) as client:
            await client.create_stream(stream, replicas=3, write_quorum=2)
            async with client.writer(stream, leadership_timeout_s=15) as writer:
                await writer.append_batch([b"before-%d" % n for n in range(100)])
            old = cluster.master
            old.kill()
            await wait_failover(cluster, old.address)
            async with client.writer(stream, leadership_timeout_s=30) as writer:
                await writer.append_batch([b"after-%d" % n for n in range(100)])
            await client.seal(stream)
            events = await read_all(client, stream)
        payloads = [payload for _, payload in events]
        expected = [b"before-%d" % n for n in range(100)] + [b"after-%d" % n for n in range(100)]
        assert payloads == expected

        backup = tmp_path / "metadata.backup"
        url = etcd.url()
        refused = run_cli("metadata", "backup", "--metadata", url, "--to", str(backup))
        assert refused.returncode != 0 and not backup.exists()
        saved = run_cli(
            "metadata", "backup", "--metadata", url, "--to", str(backup), "--certs-dir", str(admin)
        )
        assert saved.returncode == 0, saved.stdout + saved.stderr
        assert backup.stat().st_size > 0
