"""A client's heartbeats as one batch (`Leadership.writer_heartbeats`) and its lease
session (docs/design.md, "Leadership")."""

from __future__ import annotations

import pytest

from streamengine.master.core.errors import CallerGaveUp, NotFound, StreamDeleted
from streamengine.master.core.leadership import Claim, Lease, session_lease_ms
from streamengine.master.leadership import Beat, WriterView, grants_due_per_renewal
from streamengine.master.metadata import OPS_PER_TRANSACTION_MAX
from tests.metadata_backends import MetadataPlace
from tests.unit.lease_helpers import writer
from tests.unit.test_master_state import LEASE, TIMEOUT, Master

STREAMS = 100  # more grants than one metadata transaction holds


@pytest.fixture
def master(metadata_place: MetadataPlace):
    m = Master(metadata_place)
    m.stores("a", "b", "c")
    for n in range(STREAMS):
        m.state.tenancy.create_stream(f"t/s{n}", 3, 2, 0, 0, True, m.now)
    m.state.tenancy.create_stream("t/gone", 3, 2, 0, 0, True, m.now)
    m.state.tenancy.delete_stream("t/gone", m.now)
    m.now += LEASE  # past the start-up window
    yield m


def commits(master: Master) -> list[int]:
    """The operations of each commit from now on."""
    made: list[int] = []
    commit = master.catalog.commit

    def counted(batch):
        made.append(batch.ops())
        return commit(batch)

    master.catalog.commit = counted  # type: ignore[method-assign]
    return made


def test_each_heartbeat_of_a_batch_is_decided_alone_and_its_grants_committed_together(
    master: Master,
) -> None:
    names = [f"t/s{n}" for n in range(STREAMS)]
    made = commits(master)
    beats = [Beat(name, writer("w1"), 0) for name in names]
    beats += [Beat("t/none", writer("w1"), 0), Beat("t/gone", writer("w1"), 0)]
    beats += [Beat(names[0], writer("w2"), 0)]  # after w1's grant in the same batch
    answers = master.state.leadership.writer_heartbeats(beats, master.now)
    granted = answers[:STREAMS]
    assert all(isinstance(a, WriterView) and a.leads and a.secret for a in granted)
    assert isinstance(answers[STREAMS], NotFound)
    assert isinstance(answers[STREAMS + 1], StreamDeleted)
    follower = answers[STREAMS + 2]
    assert isinstance(follower, WriterView) and not follower.leads
    assert follower.lease.holder == "w1" and not follower.secret
    # One grant writes its stream and its segment: as few transactions as fit them.
    assert len(made) == -(-2 * STREAMS // OPS_PER_TRANSACTION_MAX)
    assert all(ops <= OPS_PER_TRANSACTION_MAX for ops in made)

    master.now += 10
    renewals = [Beat(name, writer("w1"), 1, acked_index=5) for name in names]
    again = master.state.leadership.writer_heartbeats(renewals, master.now)
    assert all(isinstance(a, WriterView) and a.leads and not a.secret for a in again)
    assert len(made) == -(-2 * STREAMS // OPS_PER_TRANSACTION_MAX), "a renewal writes nothing"
    assert master.state.leader_reports[names[0]].acked_index == 5


def test_a_batch_past_its_callers_deadline_decides_nothing(master: Master) -> None:
    beats = [Beat("t/s0", writer("w1"), 0), Beat("t/s1", writer("w1"), 0)]
    answers = master.state.leadership.writer_heartbeats(beats, master.now, master.now)
    assert all(isinstance(a, CallerGaveUp) for a in answers)
    assert master.state.leases["t/s0"].epoch == 0 and master.state.leases["t/s1"].epoch == 0


def test_a_sessions_end_ends_the_leases_it_renewed_unless_taken_over(master: Master) -> None:
    leadership = master.state.leadership
    assert leadership.open_session(b"s" * 16, "")
    assert not leadership.open_session(b"s" * 16, ""), "a session is held once"
    beats = [Beat(f"t/s{n}", writer("w1"), 0) for n in range(3)]
    leadership.writer_heartbeats(beats, master.now, session=b"s" * 16)
    leadership.roll_segment("t/s1", writer("w1"), 1, [], master.now)  # rolled: still its
    master.state.leases["t/s2"] = Lease(1, "w9", 0)  # since granted to another writer
    ended = leadership.session_gone(b"s" * 16, master.now + 1)
    assert ended == [("t/s0", 1), ("t/s1", 2)]
    assert not master.state.leases["t/s0"].running(master.now + 1)
    assert leadership.open_session(b"s" * 16, ""), "gone: the bytes may name a session again"


def test_one_renewal_of_a_session_renews_every_lease_bound_to_it(master: Master) -> None:
    """Bound by the batches naming the session; each renewed as its holder's heartbeat
    would renew it, whatever their number; one no longer its grant is named `ended` and
    bound no more; an unknown session, or one held by another principal, renews
    nothing."""
    leadership = master.state.leadership
    session = b"s" * 16
    assert leadership.open_session(session, "")
    beats = [Beat(f"t/s{n}", writer("w1"), 0) for n in range(STREAMS)]
    granted = leadership.writer_heartbeats(beats, master.now, session=session)
    assert all(isinstance(a, WriterView) and not a.session_incarnation for a in granted), (
        "bound for renewals only once its holder shows the secret its grant handed"
    )
    renewals = [Beat(f"t/s{n}", writer("w1"), 1) for n in range(STREAMS)]
    answers = leadership.writer_heartbeats(renewals, master.now, session=session)
    incarnations = {a.session_incarnation for a in answers if isinstance(a, WriterView)}
    assert len(incarnations) == 1 and b"" not in incarnations
    master.state.leases["t/s7"] = Lease(2, "w9", 0)  # granted to another writer since
    leadership.release_lease("t/s8", writer("w1"), 1, master.now)
    master.now += 5 * LEASE  # every lease ran out: nobody else was granted
    renewal = leadership.renew_session(session, "", master.now)
    assert renewal.incarnation in incarnations
    assert renewal.ended == ("t/s7", "t/s8")
    for n in set(range(STREAMS)) - {7, 8}:
        assert master.state.leases[f"t/s{n}"].expires_ms == master.now + LEASE
    kept = master.state.leases["t/s0"]
    master.now += LEASE // 3
    leadership.renew_session(session, "", master.now)
    assert master.state.leases["t/s0"] is kept, "it runs longer than a renewal promises"
    assert kept.expires_ms >= master.now + session_lease_ms(LEASE)
    assert master.state.leases["t/s7"].holder == "w9"
    assert leadership.renew_session(session, "", master.now).ended == (), "unbound: once"
    assert leadership.renew_session(b"x" * 16, "", master.now).incarnation == b""
    assert leadership.renew_session(session, "someone else", master.now).incarnation == b""


def test_a_renewal_names_the_bound_streams_with_a_roll_to_hear_of_until_they_ask(
    master: Master,
) -> None:
    """Looked for only when what roll reasons rest on changed since the session's last
    renewal: a store of their copy sets dead, a roll an operator asked for. Once named,
    a stream is named by every renewal until its holder heartbeats: a renewal's answer
    lost named it to nobody (the runtime world's seed 73)."""
    leadership = master.state.leadership
    session = b"s" * 16
    assert leadership.open_session(session, "")
    for epoch in (0, 1):  # granted, then renewed by its holder: bound for renewals
        beats = [Beat(f"t/s{n}", writer("w1"), epoch) for n in range(4)]
        leadership.writer_heartbeats(beats, master.now, session=session)
    assert leadership.renew_session(session, "", master.now).attention == ()
    leadership.request_roll("t/s2", master.now)
    assert leadership.renew_session(session, "", master.now).attention == ("t/s2",)
    assert leadership.renew_session(session, "", master.now).attention == ("t/s2",)
    (heard,) = leadership.writer_heartbeats(
        [Beat("t/s2", writer("w1"), 1)], master.now, session=session
    )
    assert isinstance(heard, WriterView) and heard.roll_reason
    assert leadership.renew_session(session, "", master.now).attention == (), "heard"

    def copy_set(n: int) -> tuple[str, ...]:
        stream_id = master.state.streams[f"t/s{n}"].stream_id
        return master.state.segments[(stream_id, 1)].copy_set

    silent = copy_set(0)[0]
    for store in {"a", "b", "c"} - {silent}:  # `silent` misses the store timeout
        master.state.registry.store_heartbeat(store, 0, 0, {}, master.now + TIMEOUT + 1)
    master.now += TIMEOUT + 1
    on_it = {f"t/s{n}" for n in range(4) if silent in copy_set(n)}
    assert set(leadership.renew_session(session, "", master.now).attention) == on_it


def test_a_renewal_names_the_bound_leases_whose_grant_is_due_a_few_at_a_time(
    master: Master,
) -> None:
    """A grant is renewed by its holder's heartbeat once half of it is left: the
    session's renewal asks for those heartbeats, at most `grants_due_per_renewal` at
    once, so leases bound together do not all heartbeat together."""
    leadership = master.state.leadership
    session = b"s" * 16
    assert leadership.open_session(session, "")
    for epoch in (0, 1):  # granted, then renewed by its holder: bound for renewals
        beats = [Beat(f"t/s{n}", writer("w1"), epoch) for n in range(STREAMS)]
        leadership.writer_heartbeats(beats, master.now, session=session)
    assert leadership.renew_session(session, "", master.now).attention == ()
    master.now += master.state.grant_ms // 2
    due = grants_due_per_renewal(STREAMS, LEASE, master.state.grant_ms)
    first = leadership.renew_session(session, "", master.now).attention
    assert len(first) == min(due, STREAMS)
    # The shortest grant, 4 leases: 6 renewals in its half, all named in the first 3.
    assert grants_due_per_renewal(10_000, 2_000, 8_000) * 3 >= 10_000
    renewed = leadership.writer_heartbeats(
        [Beat(name, writer("w1"), 1) for name in first], master.now, session=session
    )
    assert all(isinstance(answer, WriterView) for answer in renewed)
    assert not set(first) & set(leadership.renew_session(session, "", master.now).attention)


def test_a_grant_whose_answer_was_lost_is_not_kept_alive_by_the_session(master: Master) -> None:
    """Its writer never learned the secret, so it never leads: the session's renewals
    leave the lease to run out, and the next heartbeat wins the next epoch (before, the
    session renewed it for good: the runtime world's seed 0 never converged)."""
    leadership = master.state.leadership
    session = b"s" * 16
    assert leadership.open_session(session, "")
    (lost,) = leadership.writer_heartbeats(
        [Beat("t/s0", writer("w1"), 0)], master.now, session=session
    )
    assert isinstance(lost, WriterView) and lost.secret
    for _ in range(6):
        master.now += LEASE // 3
        leadership.renew_session(session, "", master.now)
    assert not master.state.leases["t/s0"].running(master.now)
    (again,) = leadership.writer_heartbeats(
        [Beat("t/s0", Claim("w1"), 0)], master.now, session=session
    )
    assert isinstance(again, WriterView) and again.leads and again.lease.epoch == 2


def test_a_writers_second_heartbeat_in_a_batch_is_answered_as_its_grant_not_granted(
    master: Master,
) -> None:
    """Two heartbeats of one writer, both sent before it heard of any grant: the first
    wins the lease with the secret the writer drew, the second hears of that grant
    again (its secret handed once more), and only the first counts as a grant."""
    beats = [Beat("t/s0", writer("w1"), 0), Beat("t/s0", writer("w1"), 0)]
    won, again = master.state.leadership.writer_heartbeats(beats, master.now)
    assert isinstance(won, WriterView) and isinstance(again, WriterView)
    assert (won.won, won.lease.epoch, won.secret) == (True, 1, writer("w1").secret)
    assert (again.won, again.lease.epoch, again.secret) == (False, 1, writer("w1").secret)
    assert again.leads and again.segment == won.segment
