"""`stream explain` against real processes: a writer SIGKILLed mid-batch leaves an
unsealed segment; the explanation (which writes nothing) says what the next leader's
recovery then does."""

from __future__ import annotations

import asyncio
import json
import signal

from streamengine.client import StreamClient
from streamengine.testing import Cluster, wait_until
from streamengine.tools.explain import explain_stream
from tests.integration.test_cli import run_cli
from tests.integration.writer_process import WriterProcess, read_all


async def test_explain_says_what_the_next_leaders_recovery_does(
    cluster: Cluster, writers: list[WriterProcess]
) -> None:
    name = "explain/killed"
    async with StreamClient(cluster.master_address) as client:
        await client.create_stream(name, replicas=3, write_quorum=2)
        old = WriterProcess(cluster.master_address, name, "a")
        writers.append(old)
        await wait_until(lambda: old.last_acked() >= 200, 30, "200 acked appends")
        old.signal(signal.SIGKILL)
        old.kill()
        old_epoch = old.leading_epoch()

        explanation = await asyncio.to_thread(explain_stream, cluster.master_address, name)
        [segment] = [s for s in explanation.segments if s.epoch == old_epoch]
        assert segment.quorum_reachable and not segment.problem, segment
        assert segment.next_epoch == old_epoch + 1 and segment.outcomes
        acked_then = max(p.answer.seal.acked_index for p in segment.probes if p.answer)
        assert acked_then >= 200
        # A read-only probe: asked again, the stores answer the same, fences unraised.
        again = await asyncio.to_thread(explain_stream, cluster.master_address, name)
        [same] = [s for s in again.segments if s.epoch == old_epoch]
        assert [p.answer for p in same.probes] == [p.answer for p in segment.probes]
        assert all(p.answer and p.answer.seal.fence <= old_epoch for p in segment.probes)

        async with client.writer(name, leadership_timeout_s=15) as new:
            assert new.epoch == segment.next_epoch
            await new.wait_sealed(15)
        [sealed] = [s for s in await client.list_segments(name) if s.epoch == old_epoch]
        assert sealed.sealed
        predicted = {outcome.final_index for outcome in segment.outcomes}
        assert sealed.final_index in predicted, (sealed.final_index, segment.outcomes)
        if segment.decided:
            [outcome] = {o.decision(): o for o in segment.outcomes}.values()
            assert sealed.final_index == outcome.final_index
            # The events of the old segment are the chosen EVENT copies, no more.
            chosen = sum(
                run.last_index - run.first_index + 1
                for run in outcome.chosen
                if run.kind == "EVENT"
            )
            events = [p for _, p in await read_all(client, name) if p.startswith(b"a-")]
            below = outcome.chosen[0].first_index - 1  # final copies before the first run
            assert len(events) == below + chosen

    # The CLI prints the same, as text and as JSON; a sealed stream has nothing to explain.
    text = run_cli("stream", "explain", name, "--master", cluster.master_address)
    assert text.returncode == 0, text.stderr
    as_json = run_cli("stream", "explain", name, "--json", "--master", cluster.master_address)
    assert as_json.returncode == 0, as_json.stderr
    assert json.loads(as_json.stdout)["stream"] == name
    unknown = run_cli("stream", "explain", "explain/none", "--master", cluster.master_address)
    assert unknown.returncode == 1 and "does not exist" in unknown.stderr, unknown
