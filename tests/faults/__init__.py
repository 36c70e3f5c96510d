"""The fault-injection suite: real processes, faults at random moments, a history of
every operation, and a checker that proves nothing acknowledged was lost, duplicated,
reordered or changed (FAULTS.md is the specification: checks C1-C15, scenarios S1-S15).

    python -m tests.faults --scenario S2 --seed 3 --out DIR    # one run, with its report
    python -m tests.faults --all --seeds 5 --out DIR            # the whole suite
    python -m tests.faults check DIR                            # re-check a recorded run

Modules: `payload` (self-verifying event bytes), `history` (the JSON-lines record),
`workload` (writer and reader processes on the real SDK), `checker` (pure checks over a
history and the final state), `cluster` (servers and client processes), `nemesis`
(faults), `final` (end-of-run seal, fresh reads and replica dumps), `scenarios`,
`report` (verdict, pictures, index page).
"""
