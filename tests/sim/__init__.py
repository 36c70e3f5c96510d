"""The deterministic simulator: the shipped system on one thread, from one seed.

`runtime/` is the ground it runs on: a seeded event loop in virtual time, an in-process
network with gRPC's and the data plane's surfaces, faulty disks and an etcd
(`runtime/README.md`). `runtime/world.py` is the world: the shipped master, stores and
SDK under a seeded workload and nemesis, their answers fed to the checkers
(`checkers.py`, one invariant each, `INVARIANTS`), which fail a run at the first
violation.

    python -m tests.sim SEED [--quiet]     # one seed, with its trace
    python -m tests.sim --seeds 0:50       # many, one line each
    --flaw NAME      a defect switched back into the shipped code (`RUNTIME_FLAWS`):
                     the named tests show a seed that finds each
    --soak N         N seeds from --first (1,000), liveness and safety failures apart
    make soak        10,000 seeds from 1,000
    make sim-coverage   the statements of client/, master/, segment_store/ and
                     protocol/ a fixed band of seeds executes (`covered.py`)

CI runs the band and the named seeds of `test_runtime_world.py`.
"""
