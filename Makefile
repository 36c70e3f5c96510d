# `make demo` runs a local cluster doing real work; `make test` runs every check.
VENV ?= .venv
PYTHON := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup system-deps test lint proto etcd-protos demo bench bench-peers clean faults faults-quick

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

test: lint system-deps
	$(VENV)/bin/pytest

demo: $(STAMP)
	$(PYTHON) -m deploy.demo

# Optional: the peers `streamengine bench --compare redis|nats` runs beside us (Debian's
# redis-server and nats-server, their Python clients in the venv). Tests never need them.
bench-peers:
	bash deploy/install-bench-peers.sh $(PYTHON)

# The fault suite against real processes: every implemented scenario with seeds 1..5, or
# one run to replay: `make faults SCENARIO=S7 SEED=3`. The report lands in $(FAULTS_OUT).
FAULTS_OUT ?= faults-report/$(shell date +%Y%m%d-%H%M%S)
FAULTS_SEEDS ?= 5
# PYTHONPATH: this tree's code, in the harness and in every process it starts.
FAULTS_RUN := PYTHONPATH=proto:.$(if $(PYTHONPATH),:$(PYTHONPATH)) $(PYTHON) -m tests.faults
faults: $(STAMP)
	$(FAULTS_RUN) --out $(FAULTS_OUT) \
		$(if $(SCENARIO),--scenario $(SCENARIO)) \
		$(if $(SEED),--seed $(SEED),--seeds $(FAULTS_SEEDS))

# Every scenario once with short windows (CI: the suite never rots).
faults-quick: $(STAMP)
	$(FAULTS_RUN) --quick --out $(FAULTS_OUT)

proto: $(STAMP)
	$(PYTHON) proto/generate.py

# Copy etcd's protos again from Debian's golang-etcd-server-dev (then `make proto`).
etcd-protos: $(STAMP)
	$(PYTHON) proto/etcd_protos.py

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
