#!/usr/bin/env bash
# A Stream Engine cluster across network namespaces: the master, each store and a client
# host get their own namespace and address on a private bridge, as separate machines
# would. Everything it creates lives inside namespaces it creates; nothing is routed
# from the host's own network.
#
#   netns-cluster.sh up STORES DATA_DIR   create hosts, start master + stores
#   netns-cluster.sh up-ha STORES DATA_DIR  the same with three master hosts (master0..2),
#                                         each running an etcd member and a master on
#                                         that 3-member etcd: one active, two standbys.
#                                         Everything speaks TLS with certificates under
#                                         DATA_DIR/certs (client/: the CLI's certs dir),
#                                         and etcd's auth lets the masters alone in
#                                         (`streamengine metadata secure`)
#   netns-cluster.sh masters DATA_DIR     the masters' list (HOST:PORT,...) of a cluster
#   netns-cluster.sh down DATA_DIR        stop processes, delete every namespace
#   netns-cluster.sh exec HOST CMD...     run CMD on HOST (master, store0.., client)
#   netns-cluster.sh addr HOST            HOST's address
#   netns-cluster.sh cut HOST             drop all of HOST's traffic (iptables)
#   netns-cluster.sh heal HOST            let it through again
#   netns-cluster.sh check                exit 0 if namespaces can be created here
#   netns-cluster.sh hosts HOST...        only create hosts (master, client, storeN,
#                                         writerN, readerN), plus a link from this
#                                         namespace to the bridge (address .254) so
#                                         a harness here reaches every host
#   netns-cluster.sh partition HOST PEER...  HOST and each PEER drop each other's traffic
#   netns-cluster.sh oneway HOST PEER...  HOST drops what comes from each PEER only
#   netns-cluster.sh lossy HOST PERCENT PEER...  HOST drops PERCENT % of the packets it
#                                         exchanges with each PEER, at random, each way
#
# Needs root, iproute2, (for cut/heal/partition) iptables, and (for up-ha) etcd.
# SE_NETNS_PREFIX (default "se") names the namespaces so parallel runs do not collide;
# SE_NETNS_SUBNET (default 10.213.7) is the private /24 (give parallel `hosts` runs
# different ones).
set -euo pipefail

prefix="${SE_NETNS_PREFIX:-se}"
subnet="${SE_NETNS_SUBNET:-10.213.7}"
master_port=7070
store_port=7071
here="$(cd "$(dirname "$0")" && pwd)"
streamengine="${STREAMENGINE:-$here/../.venv/bin/streamengine}"
python="$(dirname "$streamengine")/python"
etcd="${ETCD:-etcd}"
etcd_client_port=2379
etcd_peer_port=2380
hub="${prefix}-hub"

ns() { echo "${prefix}-$1"; }

host_number() {
  case "$1" in
    master) echo 1 ;;
    master[0-9]*) echo $((40 + ${1#master})) ;;
    client) echo 2 ;;
    store*) echo $((10 + ${1#store})) ;;
    writer*) echo $((20 + ${1#writer})) ;;
    reader*) echo $((30 + ${1#reader})) ;;
    harness) echo 254 ;;
    *) echo "unknown host $1" >&2; exit 2 ;;
  esac
}

addr() { echo "${subnet}.$(host_number "$1")"; }

add_host() {
  local host="$1" number
  number="$(host_number "$host")"
  ip netns add "$(ns "$host")"
  ip link add "${prefix}${number}h" type veth peer name "${prefix}${number}p"
  ip link set "${prefix}${number}h" netns "$hub"
  ip -n "$hub" link set "${prefix}${number}h" master br0 up
  ip link set "${prefix}${number}p" netns "$(ns "$host")"
  ip -n "$(ns "$host")" link set "${prefix}${number}p" name eth0
  ip -n "$(ns "$host")" addr add "$(addr "$host")/24" dev eth0
  ip -n "$(ns "$host")" link set eth0 up
  ip -n "$(ns "$host")" link set lo up
}

start() {
  local host="$1" data="$2"; shift 2
  ip netns exec "$(ns "$host")" setsid "$streamengine" "$@" >"$data/$host.log" 2>&1 < /dev/null &
  echo $! >"$data/$host.pid"
}

# up-ha's certificates under DATA/certs: the CA (ca/), a dir per master, etcd member and
# store, each naming its host's address, and client/ with client.root for the CLI.
make_certs() {
  local data="$1" stores="$2" nodes=() i
  for i in 0 1 2; do
    nodes+=("master$i:master:$(addr "master$i")" "etcd$i:etcd:$(addr "master$i")")
  done
  for ((i = 0; i < stores; i++)); do nodes+=("store$i:store:$(addr "store$i")"); done
  "$python" "$here/netns_certs.py" "$data/certs" "${nodes[@]}"
}

# An etcd member on HOST (logs and pid as etcd-HOST), one of the cluster INITIAL, with
# TLS for clients and peers and a certificate of the cluster's CA asked of both.
start_etcd() {
  local host="$1" data="$2" initial="$3" address pki="$2/certs/etcd${1#master}"
  address="$(addr "$host")"
  mkdir -p "$data/etcd-$host-db"
  chmod 700 "$data/etcd-$host-db"
  ip netns exec "$(ns "$host")" setsid "$etcd" --name "$host" --data-dir "$data/etcd-$host-db" \
    --cert-file "$pki/node.crt" --key-file "$pki/node.key" --trusted-ca-file "$pki/ca.crt" \
    --client-cert-auth --peer-cert-file "$pki/node.crt" --peer-key-file "$pki/node.key" \
    --peer-trusted-ca-file "$pki/ca.crt" --peer-client-cert-auth \
    --listen-client-urls "https://$address:$etcd_client_port" \
    --advertise-client-urls "https://$address:$etcd_client_port" \
    --listen-peer-urls "https://$address:$etcd_peer_port" \
    --initial-advertise-peer-urls "https://$address:$etcd_peer_port" \
    --initial-cluster "$initial" --initial-cluster-state new \
    --heartbeat-interval 50 --election-timeout 500 --logger zap --log-outputs stderr \
    >"$data/etcd-$host.log" 2>&1 < /dev/null &
  echo $! >"$data/etcd-$host.pid"
}

cmd_up() {
  local stores="$1" data="$2" i
  mkdir -p "$data"
  ip netns add "$hub"
  ip -n "$hub" link add br0 type bridge
  ip -n "$hub" link set br0 up
  add_host master
  add_host client
  for ((i = 0; i < stores; i++)); do add_host "store$i"; done
  echo "$stores" >"$data/stores"
  # Plaintext (--insecure) on the namespaces' own private bridge: test hosts only.
  start master "$data" master --listen "$(addr master):$master_port" --data "$data/master-db" \
    --lease-ms 1000 --store-timeout-ms 3000 --insecure
  for ((i = 0; i < stores; i++)); do
    start "store$i" "$data" store --listen "$(addr "store$i"):$store_port" --data "$data/store$i-db" \
      --master "$(addr master):$master_port" --id "store$i" --zone "zone$i" --insecure
  done
  echo "master $(addr master):$master_port"
}

cmd_up_ha() {
  local stores="$1" data="$2" i initial="" endpoints="" masters=""
  mkdir -p "$data"
  ip netns add "$hub"
  ip -n "$hub" link add br0 type bridge
  ip -n "$hub" link set br0 up
  for i in 0 1 2; do
    add_host "master$i"
    initial+="${initial:+,}master$i=https://$(addr "master$i"):$etcd_peer_port"
    endpoints+="${endpoints:+,}$(addr "master$i"):$etcd_client_port"
    masters+="${masters:+,}$(addr "master$i"):$master_port"
  done
  add_host client
  for ((i = 0; i < stores; i++)); do add_host "store$i"; done
  echo "$stores" >"$data/stores"
  echo "$masters" >"$data/masters"
  make_certs "$data" "$stores"
  for i in 0 1 2; do start_etcd "master$i" "$data" "$initial"; done
  secure_etcd "$data" "etcd://$endpoints/streamengine"
  for i in 0 1 2; do
    start "master$i" "$data" master --listen "$(addr "master$i"):$master_port" \
      --metadata "etcd://$endpoints/streamengine" --data "$data/master$i-files" \
      --lease-ms 1000 --store-timeout-ms 3000 --certs-dir "$data/certs/master$i"
  done
  for ((i = 0; i < stores; i++)); do
    start "store$i" "$data" store --listen "$(addr "store$i"):$store_port" --data "$data/store$i-db" \
      --master "$masters" --id "store$i" --zone "zone$i" --certs-dir "$data/certs/store$i"
  done
  echo "masters $masters"
}

# etcd's auth on, from master0's host, once the new etcd answers (a bounded wait):
# only the masters' certificates reach the cluster's keys.
secure_etcd() {
  local data="$1" url="$2" attempt
  for attempt in $(seq 1 30); do
    if ip netns exec "$(ns master0)" "$streamengine" metadata secure --metadata "$url" \
      --certs-dir "$data/certs/client" --ca-key "$data/certs/ca/ca.key" \
      >>"$data/secure.log" 2>&1; then
      return 0
    fi
    sleep 0.2
  done
  echo "etcd did not answer metadata secure: $data/secure.log" >&2
  return 1
}

cmd_masters() {
  local data="$1"
  if [ -f "$data/masters" ]; then cat "$data/masters"; else echo "$(addr master):$master_port"; fi
}

cmd_hosts() {
  local host
  ip netns add "$hub"
  ip -n "$hub" link add br0 type bridge
  ip -n "$hub" link set br0 up
  for host in "$@"; do add_host "$host"; done
  # This namespace joins the bridge too: the harness talks to every host directly.
  ip link add "${prefix}254h" type veth peer name "${prefix}254r"
  ip link set "${prefix}254h" netns "$hub"
  ip -n "$hub" link set "${prefix}254h" master br0 up
  ip addr add "$(addr harness)/24" dev "${prefix}254r"
  ip link set "${prefix}254r" up
}

cmd_partition() {
  local host="$1" peer; shift
  for peer in "$@"; do
    ip netns exec "$(ns "$host")" iptables -A INPUT -s "$(addr "$peer")" -j DROP
    ip netns exec "$(ns "$host")" iptables -A OUTPUT -d "$(addr "$peer")" -j DROP
  done
}

cmd_oneway() {
  local host="$1" peer; shift
  for peer in "$@"; do
    ip netns exec "$(ns "$host")" iptables -A INPUT -s "$(addr "$peer")" -j DROP
  done
}

cmd_lossy() {
  local host="$1" percent="$2" peer probability; shift 2
  probability="$(awk -v p="$percent" 'BEGIN { printf "%.4f", p / 100 }')"
  for peer in "$@"; do
    ip netns exec "$(ns "$host")" iptables -A INPUT -s "$(addr "$peer")" \
      -m statistic --mode random --probability "$probability" -j DROP
    ip netns exec "$(ns "$host")" iptables -A OUTPUT -d "$(addr "$peer")" \
      -m statistic --mode random --probability "$probability" -j DROP
  done
}

cmd_down() {
  local data="${1:-}" pidfile name
  if [ -n "$data" ] && [ -d "$data" ]; then
    for pidfile in "$data"/*.pid; do
      [ -e "$pidfile" ] || continue
      kill -KILL "$(cat "$pidfile")" 2>/dev/null || true
      rm -f "$pidfile"
    done
  fi
  for name in $(ip netns list | awk '{print $1}' | grep "^${prefix}-" || true); do
    # Processes still inside (started by `exec`) die with their namespace's last link.
    for pid in $(ip netns pids "$name" 2>/dev/null); do kill -KILL "$pid" 2>/dev/null || true; done
    ip netns del "$name" 2>/dev/null || true
  done
  # The harness link of `hosts` (its peer went with the hub namespace; this is a guard).
  ip link del "${prefix}254r" 2>/dev/null || true
}

cmd_cut() {
  local space
  space="$(ns "$1")"
  ip netns exec "$space" iptables -A INPUT ! -i lo -j DROP
  ip netns exec "$space" iptables -A OUTPUT ! -o lo -j DROP
}

cmd_heal() { ip netns exec "$(ns "$1")" iptables -F; }

cmd_check() {
  local probe="${prefix}-probe-$$"
  [ "$(id -u)" -eq 0 ] || { echo "needs root"; exit 1; }
  command -v ip >/dev/null || { echo "needs iproute2"; exit 1; }
  command -v iptables >/dev/null || { echo "needs iptables"; exit 1; }
  ip netns add "$probe" 2>/dev/null || { echo "cannot create network namespaces here"; exit 1; }
  ip netns del "$probe"
}

action="${1:-}"
shift || true
case "$action" in
  up) cmd_up "$@" ;;
  up-ha) cmd_up_ha "$@" ;;
  masters) cmd_masters "$@" ;;
  down) cmd_down "$@" ;;
  exec) host="$1"; shift; exec ip netns exec "$(ns "$host")" "$@" ;;
  addr) addr "$1" ;;
  cut) cmd_cut "$1" ;;
  heal) cmd_heal "$1" ;;
  check) cmd_check ;;
  hosts) cmd_hosts "$@" ;;
  partition) cmd_partition "$@" ;;
  oneway) cmd_oneway "$@" ;;
  lossy) cmd_lossy "$@" ;;
  *) sed -n '2,29p' "$0"; exit 2 ;;
esac
