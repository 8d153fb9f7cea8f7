#!/usr/bin/env bash
# The browser tests drive Debian's chromium through Playwright (never a browser download).
# Install it where it is missing.
set -euo pipefail
if [[ -x /usr/bin/chromium ]]; then
  exit 0
fi
SUDO=""
if [[ $(id -u) -ne 0 ]]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get install -y -q --no-install-recommends chromium >/dev/null 2>&1 || {
  $SUDO apt-get update -q >/dev/null
  $SUDO apt-get install -y -q --no-install-recommends chromium >/dev/null
}
/usr/bin/chromium --version
