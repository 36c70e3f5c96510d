"""`stream explain`'s decisions: the writer's planner over every set of R stores."""

from __future__ import annotations

from streamengine.client.core.recovery_plan import SealAnswer, StoreAnswer
from streamengine.protocol.entry import EntryKind, StoredEntry
from streamengine.protocol.policy import ReplicationPolicy
from streamengine.tools.explain import Run, explain_answers, first_index_to_read


def holding(store: str, acked: int, last: int, epoch: int = 1) -> StoreAnswer:
    entries = tuple(
        StoredEntry.make(index, EntryKind.EVENT, epoch, b"e%d" % index)
        for index in range(1, last + 1)
    )
    return StoreAnswer(SealAnswer(store, epoch, acked, last, last), entries)


def test_stores_that_agree_give_one_decision() -> None:
    answers = [holding("s1", 3, 5), holding("s2", 2, 5), holding("s3", 3, 5)]
    outcomes = explain_answers(ReplicationPolicy(3, 2), 2, answers)
    assert len(outcomes) == 3 and len({o.decision() for o in outcomes}) == 1
    first = outcomes[0]
    assert (first.acked_index, first.final_index, first.existing_bridge) == (3, 6, False)
    assert first.chosen == (Run(4, 5, "EVENT"), Run(6, 6, "BRIDGE"))
    # Every store that answers is bridged from its own acked index.
    assert first.rewrites == {"s1": (4, 6), "s2": (3, 6), "s3": (4, 6)}


def test_an_entry_on_one_store_depends_on_who_answers_first() -> None:
    # Index 5 is on s1 alone: deciding from s1 keeps it, deciding without s1 makes the
    # run end at 4.
    answers = [holding("s1", 3, 5), holding("s2", 3, 4), holding("s3", 3, 4)]
    outcomes = explain_answers(ReplicationPolicy(3, 2), 2, answers)
    finals = {o.decided_from: o.final_index for o in outcomes}
    assert finals == {("s1", "s2"): 6, ("s1", "s3"): 6, ("s2", "s3"): 5}


def test_every_set_of_r_answers_finds_its_final_copies_in_what_was_read() -> None:
    """Stores acked unevenly (a writer killed mid-stream): a set of R stores acked lowest
    reads from its own acked index, below where the whole copy set would read from."""
    full = [holding("s0", 280, 280), holding("s1", 260, 280), holding("s2", 260, 270)]
    start = first_index_to_read([a.seal for a in full])
    assert start == 260
    read = [
        StoreAnswer(a.seal, tuple(e for e in a.entries if e.index >= start)) for a in full
    ]
    outcomes = explain_answers(ReplicationPolicy(3, 2), 2, read)
    assert len(outcomes) == 3  # {s1, s2} planned too: it needs index 260
