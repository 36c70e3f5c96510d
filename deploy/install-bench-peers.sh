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
  sudo_cmd=""
  [ "$(id -u)" -eq 0 ] || sudo_cmd="sudo"
  echo "install-bench-peers: installing ${missing[*]}"
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq "${missing[@]}" >/dev/null
  # Debian's redis-server enables a system Redis on 127.0.0.1:6379 where systemd runs. The
  # benchmark starts its own servers on free ports: do not leave an unasked-for one running.
  if [[ " ${missing[*]} " == *" redis-server "* ]] && command -v systemctl >/dev/null 2>&1; then
    $sudo_cmd systemctl disable --now redis-server >/dev/null 2>&1 || true
  fi
fi

# Only the clients: bench/peers/requirements.txt records the versions first measured with
# (it also pins the project's own dependencies, which pyproject.toml governs here).
if ! "$python" -c 'import redis, hiredis, nats' >/dev/null 2>&1; then
  echo "install-bench-peers: installing the clients redis, hiredis, nats-py"
  "$python" -m pip install -q 'redis>=5' 'hiredis>=2' 'nats-py>=2.6'
fi
echo "install-bench-peers: $(redis-server --version | cut -d' ' -f1-3), $(nats-server --version), clients in $python"
