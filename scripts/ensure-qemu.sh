#!/usr/bin/env bash
# The `vm` isolation tier's tests boot real QEMU/KVM guests (TCG where /dev/kvm is missing):
# Debian's qemu-system-x86 and qemu-utils (qemu-img, for the per-run qcow2 overlays). The test
# guest (rackplane_bench/vmguest.py) is a Debian kernel plus a busybox initramfs with dropbear, built in
# the tests: the kernel's package is downloaded and unpacked into the guest cache, never
# installed on this host. Install what is missing, as scripts/ensure-ha.sh does for the HA
# engines; idempotent, and no service is started (QEMU has none).
set -euo pipefail
CACHE=${RACKPLANE_TEST_GUEST_CACHE:-/var/cache/rackplane-test-guest}
need=()
command -v qemu-system-x86_64 >/dev/null 2>&1 || need+=(qemu-system-x86)
command -v qemu-img >/dev/null 2>&1 || need+=(qemu-utils)
# The guest's userland: one static busybox (Debian's plain `busybox` is dynamically linked).
if ! [[ -x /bin/busybox ]] || [[ $(LC_ALL=C ldd /bin/busybox 2>&1 || true) != *"not a dynamic"* ]]; then
  need+=(busybox-static)
fi
# The guest's SSH server: dropbear, copied into the initramfs with its shared libraries.
command -v dropbear >/dev/null 2>&1 || [[ -x /usr/sbin/dropbear ]] || need+=(dropbear-bin)
SUDO=""
if [[ $(id -u) -ne 0 ]]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
updated=""
if [[ ${#need[@]} -gt 0 ]]; then
  printf '#!/bin/sh\nexit 101\n' | $SUDO tee /usr/sbin/policy-rc.d >/dev/null
  $SUDO chmod +x /usr/sbin/policy-rc.d
  trap '$SUDO rm -f /usr/sbin/policy-rc.d' EXIT
  $SUDO apt-get install -y -q --no-install-recommends "${need[@]}" >/dev/null 2>&1 || {
    $SUDO apt-get update -q >/dev/null
    updated=1
    $SUDO apt-get install -y -q --no-install-recommends "${need[@]}" >/dev/null
  }
fi
# The guest's kernel: the image package linux-image-amd64 points at, unpacked (not installed)
# into $CACHE/linux/ (vmlinuz and its modules), once.
if ! compgen -G "$CACHE/linux/boot/vmlinuz-*" >/dev/null; then
  pkg=$(apt-cache depends linux-image-amd64 2>/dev/null | awk '/Depends: linux-image-[0-9]/ {print $2; exit}')
  if [[ -z $pkg && -z $updated ]]; then
    $SUDO apt-get update -q >/dev/null
    pkg=$(apt-cache depends linux-image-amd64 | awk '/Depends: linux-image-[0-9]/ {print $2; exit}')
  fi
  [[ -n $pkg ]] || { echo "ensure-qemu: no kernel package behind linux-image-amd64" >&2; exit 1; }
  $SUDO mkdir -p "$CACHE"
  tmp=$($SUDO mktemp -d "$CACHE/.download.XXXXXX")
  (cd "$tmp" && $SUDO apt-get download -q "$pkg" >/dev/null 2>&1) || {
    $SUDO apt-get update -q >/dev/null
    (cd "$tmp" && $SUDO apt-get download -q "$pkg" >/dev/null)
  }
  $SUDO dpkg-deb -x "$tmp"/*.deb "$tmp/linux"
  $SUDO rm -rf "$CACHE/linux"
  $SUDO mv "$tmp/linux" "$CACHE/linux"
  $SUDO rm -rf "$tmp"
fi
qemu-system-x86_64 --version | head -n 1
