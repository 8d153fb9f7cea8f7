#!/usr/bin/env bash
# The `container` isolation tier's tests run real rootful podman containers with runc (this
# host's cgroup v1 is refused by crun), from an image built locally out of busybox-static (see
# rackplane_bench/containers.py), never pulled. Install Debian's packages where they are missing, as
# scripts/ensure-ha.sh does for the HA engines. No service is started: podman is daemonless.
set -euo pipefail
need=()
command -v podman >/dev/null 2>&1 || need+=(podman)
command -v runc >/dev/null 2>&1 || need+=(runc)
command -v conmon >/dev/null 2>&1 || need+=(conmon)
# The network backend podman 4.3 picks when neither is configured: netavark (+ aardvark-dns),
# which drives the per-tenant bridges with iptables (nf_tables flavour).
[[ -x /usr/lib/podman/netavark ]] || need+=(netavark)
[[ -x /usr/lib/podman/aardvark-dns ]] || need+=(aardvark-dns)
command -v iptables >/dev/null 2>&1 || need+=(iptables)
# newuidmap/newgidmap and the subid library, for --userns=auto / --uidmap.
command -v newuidmap >/dev/null 2>&1 || need+=(uidmap)
# The init the agent's podman runtime asks for (`--init`: PID 1 forwards the stop's SIGTERM and
# reaps); podman looks for it at its default init_path. Only Recommended by Debian's podman.
[[ -x /usr/libexec/podman/catatonit ]] || need+=(catatonit)
# The image's rootfs: one static /bin/busybox with applet links.
# (Debian's plain `busybox` is dynamically linked, hence the ldd check.)
if ! [[ -x /bin/busybox ]] || [[ $(LC_ALL=C ldd /bin/busybox 2>&1 || true) != *"not a dynamic"* ]]; then
  need+=(busybox-static)
fi
# An SSH server for the image: dropbear, copied in with its shared libraries.
command -v dropbear >/dev/null 2>&1 || [[ -x /usr/sbin/dropbear ]] || need+=(dropbear-bin)
# The client the instance tests and `rackplane bench instances` log in with (ssh, ssh-keygen).
command -v ssh >/dev/null 2>&1 && command -v ssh-keygen >/dev/null 2>&1 || need+=(openssh-client)
SUDO=""
if [[ $(id -u) -ne 0 ]]; then SUDO="sudo"; fi
# --userns=auto (rootful) takes its ranges from the subordinate IDs of the user "containers"
# (who need not exist): give it the upper half of the 32-bit space, as podman's docs suggest.
for f in /etc/subuid /etc/subgid; do
  if ! grep -q '^containers:' "$f" 2>/dev/null; then
    echo "containers:2147483647:2147483648" | $SUDO tee -a "$f" >/dev/null
  fi
done
if [[ ${#need[@]} -eq 0 ]]; then
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
# Nothing here should start a service (dropbear-bin has none, but keep the guard uniform).
printf '#!/bin/sh\nexit 101\n' | $SUDO tee /usr/sbin/policy-rc.d >/dev/null
$SUDO chmod +x /usr/sbin/policy-rc.d
trap '$SUDO rm -f /usr/sbin/policy-rc.d' EXIT
$SUDO apt-get install -y -q --no-install-recommends "${need[@]}" >/dev/null 2>&1 || {
  $SUDO apt-get update -q >/dev/null
  $SUDO apt-get install -y -q --no-install-recommends "${need[@]}" >/dev/null
}
podman --version
