#!/usr/bin/env bash
# The peers `streamengine bench --compare redis|nats` measures beside us (bench/peers/):
# Debian's redis-server and nats-server, and their Python clients in the project's venv.
# Optional: nothing else (tests included) needs them. Idempotent: installs only what is
# missing. Usage: install-bench-peers.sh PYTHON (the venv's python; `make bench-peers`).
set -euo pipefail

python="${1:-.venv/bin/python}"
if ! [ -x "$python" ]; then
  echo "install-bench-peers: $python not found; run \`make setup\` first" >&2
  exit 1
fi

missing=()
command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
command -v nats-server >/dev/null 2>&1 || missing+=(nats-server)
if [ ${#missing[@]} -gt 0 ]; then
  if ! command -v apt-get >/dev/null 2>&1; then
    echo "install-bench-peers: missing ${missing[*]} and apt-get is not available; install them by hand" >&2
    exit 1
  fi
  # shellcheck source=deploy/apt.sh
  source "$(dirname "$0")/apt.sh"
  apt_install install-bench-peers "${missing[@]}"
  # The benchmark starts its own servers on free ports.
  if [[ " ${missing[*]} " == *" redis-server "* ]]; then disable_service redis-server; fi
fi

# Only the clients: bench/peers/requirements.txt records the versions first measured with
# (it also pins the project's own dependencies, which pyproject.toml governs here).
if ! "$python" -c 'import redis, hiredis, nats' >/dev/null 2>&1; then
  echo "install-bench-peers: installing the clients redis, hiredis, nats-py"
  "$python" -m pip install -q 'redis>=5' 'hiredis>=2' 'nats-py>=2.6'
fi
echo "install-bench-peers: $(redis-server --version | cut -d' ' -f1-3), $(nats-server --version), clients in $python"
