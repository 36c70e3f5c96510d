# Sourced by the install scripts: apt-get as root (or through sudo), quietly.

# apt_install WHO PACKAGE...: install the packages, saying so as WHO.
apt_install() {
  local who="$1"
  shift
  echo "$who: installing $*"
  as_root apt-get update -qq
  DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq "$@" >/dev/null
}

# disable_service NAME: Debian starts a system service with some packages (etcd, Redis)
# where systemd runs; the project starts its own on free ports, so none is left running.
disable_service() {
  if command -v systemctl >/dev/null 2>&1; then
    as_root systemctl disable --now "$1" >/dev/null 2>&1 || true
  fi
}

as_root() {
  if [ "$(id -u)" -eq 0 ]; then
    "$@"
  else
    sudo "$@"
  fi
}
