#!/usr/bin/env bash
# The high-availability tests run the engines operators run for it, from Debian's packages:
# Redis Sentinel (and, for the PostgreSQL failover, Patroni with etcd). Install them where they
# are missing, as the browser tests' chromium is.
set -euo pipefail
need=()
command -v redis-sentinel >/dev/null 2>&1 || need+=(redis-sentinel)
command -v patroni >/dev/null 2>&1 || need+=(patroni)
command -v etcd >/dev/null 2>&1 || need+=(etcd-server)
if [[ ${#need[@]} -eq 0 ]]; then
  exit 0
fi
SUDO=""
if [[ $(id -u) -ne 0 ]]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
# The packages' own services (a Sentinel on 26379, an etcd on 2379) are not wanted: the tests
# start their own on other ports. policy-rc.d keeps the maintainer scripts from starting them.
printf '#!/bin/sh\nexit 101\n' | $SUDO tee /usr/sbin/policy-rc.d >/dev/null
$SUDO chmod +x /usr/sbin/policy-rc.d
trap '$SUDO rm -f /usr/sbin/policy-rc.d' EXIT
$SUDO apt-get install -y -q --no-install-recommends "${need[@]}" >/dev/null 2>&1 || {
  $SUDO apt-get update -q >/dev/null
  $SUDO apt-get install -y -q --no-install-recommends "${need[@]}" >/dev/null
}
redis-sentinel --version
