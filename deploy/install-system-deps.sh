#!/usr/bin/env bash
# Debian packages the project needs beyond Python: a Java runtime for PySpark (17+).
# Idempotent; installs only what is missing, and only where apt-get can run.
set -euo pipefail

java_major() {
  java -version 2>&1 | sed -n 's/.*version "\([0-9]*\).*/\1/p' | head -n1
}

if command -v java >/dev/null 2>&1 && [ "$(java_major)" -ge 17 ] 2>/dev/null; then
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "install-system-deps: Java 17+ is missing and apt-get is not available; install a JDK/JRE 17+ by hand" >&2
  exit 1
fi
sudo_cmd=""
[ "$(id -u)" -eq 0 ] || sudo_cmd="sudo"
echo "install-system-deps: installing openjdk-17-jre-headless (PySpark needs Java 17+)"
$sudo_cmd apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq openjdk-17-jre-headless >/dev/null
