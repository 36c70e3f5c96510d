# `make demo` runs a local cluster doing real work; `make test` runs every check.
VENV ?= .venv
PYTHON := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup system-deps test test-slow lint proto etcd-protos demo bench bench-peers clean faults faults-long faults-quick soak sim-coverage

$(STAMP): pyproject.toml
	test -x $(PYTHON) || python3 -m venv $(VENV)
	$(PYTHON) -m pip install -q --upgrade pip
	$(PYTHON) -m pip install -q -e '.[dev,spark]'
	bash deploy/install-system-deps.sh
	touch $(STAMP)

setup: $(STAMP)

# Java, etcd, iproute2, ...: checked on every `make test` (cheap when all are there), so
# a checkout that was set up before a new one was needed gets it too.
system-deps:
	bash deploy/install-system-deps.sh

lint: $(STAMP)
	$(PYTHON) proto/generate.py --check
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

# Everything but the fault suite's quick pass and the netns tests on two workers
# (tests/conftest.py says what runs together), then those alone: their liveness bounds
# are for a box of their own. The second pass collects only their files (conftest.py's
# SYSTEM_WIDE; the first pass fails a test marked so elsewhere), not the whole tree again.
# `.venv/bin/pytest` alone runs everything in one process.
test: lint system-deps
	$(VENV)/bin/pytest -n 2 -m "not faults and not netns and not slow"
	$(VENV)/bin/pytest -m "faults or netns" tests/faults tests/integration/test_netns.py

# Tests past CI's budget of seconds per test, marked `slow` (none today).
test-slow: $(STAMP)
	$(VENV)/bin/pytest -m slow

demo: $(STAMP)
	$(PYTHON) -m deploy.demo

# Optional: the peers `streamengine bench --compare redis|nats` runs beside us (Debian's
# redis-server and nats-server, their Python clients in the venv). Tests never need them.
bench-peers:
	bash deploy/install-bench-peers.sh $(PYTHON)

# The fault suite against real processes. `make faults`: every implemented scenario with
# seeds 1..5, the quick pass's dense schedules with windows 3x as long (about 85 minutes
# on two cores); `make faults SCENARIO=S7 SEED=3` replays one such run. `make faults-long`:
# FAULTS.md's schedules and durations (about 75 minutes a seed; FAULTS_SEEDS=5 is the
# release gate). `make faults-quick`: the CI pass. The report lands in $(FAULTS_OUT).
FAULTS_OUT ?= faults-report/$(shell date +%Y%m%d-%H%M%S)
FAULTS_SEEDS ?= 5
# PYTHONPATH: this tree's code (tests/tree.py), in the harness and every process it starts.
TREE_PYTHON = PYTHONPATH=client:master:segment_store:protocol:tools:testing:proto:.$(if $(PYTHONPATH),:$(PYTHONPATH)) $(PYTHON)
FAULTS_RUN = $(TREE_PYTHON) -m tests.faults \
	--out $(FAULTS_OUT) $(if $(SCENARIO),--scenario $(SCENARIO))
faults: $(STAMP)
	$(FAULTS_RUN) --standard $(if $(SEED),--seed $(SEED),--seeds $(FAULTS_SEEDS))

faults-long: $(STAMP)
	$(FAULTS_RUN) $(if $(SEED),--seed $(SEED),--seeds $(if $(filter command line environment,$(origin FAULTS_SEEDS)),$(FAULTS_SEEDS),1))

faults-quick: $(STAMP)
	$(FAULTS_RUN) --quick $(if $(SEED),--seed $(SEED))

# The simulator (tests/sim), beyond what CI runs. `make soak`: 10,000 seeds from seed
# 1,000 (above the CI band and the named seeds), liveness and safety failures counted
# apart, one process per core: 1-20 s a seed, about 3 s on average on an idle core,
# so 4-5 hours on two cores; `make soak SOAK_SEEDS=500 SOAK_FIRST=3000` runs a band.
# `make sim-coverage`: the share of client/, master/, segment_store/ and protocol/
# statements a fixed band of seeds executes, per part and per module
# (tests/sim/covered.py).
SOAK_SEEDS ?= 10000
SOAK_FIRST ?= 1000
soak: $(STAMP)
	$(TREE_PYTHON) -m tests.sim --soak $(SOAK_SEEDS) --first $(SOAK_FIRST)

sim-coverage: $(STAMP)
	$(TREE_PYTHON) -m tests.sim.covered

proto: $(STAMP)
	$(PYTHON) proto/generate.py

# Copy etcd's protos again from Debian's golang-etcd-server-dev (then `make proto`).
etcd-protos: $(STAMP)
	$(PYTHON) proto/etcd_protos.py

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
