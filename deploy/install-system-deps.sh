#!/usr/bin/env bash
# Debian packages the project needs beyond Python. Idempotent: installs only what is
# missing, and only where apt-get can run.
set -euo pipefail

# Java 17+ for PySpark; etcd (server and etcdctl) for the masters' shared metadata and
# election (tests start their own members on free ports); iproute2 and iptables for the
# network-namespace cluster test and the fault suite's partitions; libfaketime for its
# clock faults and libfuse2 (for fusepy) for its lazy file system (tests/faults, S4 and
# S8); chromium and its driver for the console's browser test.
java_major() {
  java -version 2>&1 | sed -n 's/.*version "\([0-9]*\).*/\1/p' | head -n1
}

missing=()
if ! command -v java >/dev/null 2>&1 || ! [ "$(java_major)" -ge 17 ] 2>/dev/null; then
  missing+=(openjdk-17-jre-headless)
fi
command -v etcd >/dev/null 2>&1 || [ -x /usr/bin/etcd ] || missing+=(etcd-server)
command -v etcdctl >/dev/null 2>&1 || missing+=(etcd-client)
command -v ip >/dev/null 2>&1 || [ -x /usr/sbin/ip ] || missing+=(iproute2)
command -v iptables >/dev/null 2>&1 || [ -x /usr/sbin/iptables ] || missing+=(iptables)
command -v faketime >/dev/null 2>&1 || missing+=(faketime)
ldconfig -p 2>/dev/null | grep -q 'libfuse\.so\.2' || missing+=(libfuse2)
# A headless browser for the master console's test (tests/integration/test_console.py).
command -v chromium >/dev/null 2>&1 || missing+=(chromium)
command -v chromedriver >/dev/null 2>&1 || missing+=(chromium-driver)
[ ${#missing[@]} -eq 0 ] && exit 0

if ! command -v apt-get >/dev/null 2>&1; then
  echo "install-system-deps: missing ${missing[*]} and apt-get is not available; install them by hand" >&2
  # Java is required (Spark tests); the others only enable the etcd, network-namespace
  # and fault tests, which skip without them.
  [[ " ${missing[*]} " == *" openjdk-17-jre-headless "* ]] && exit 1
  exit 0
fi
# shellcheck source=deploy/apt.sh
source "$(dirname "$0")/apt.sh"
apt_install install-system-deps "${missing[@]}"
# The project starts its own etcd members (tests, deploy/netns-cluster.sh, deploy/systemd).
if [[ " ${missing[*]} " == *" etcd-server "* ]]; then disable_service etcd; fi
