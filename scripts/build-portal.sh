#!/usr/bin/env bash
# Build the portal page (portal/ -> app/portal/dist) from the committed package-lock.json with
# the machine's Node.js and npm. --optional: without npm, say so and go on (the API still runs;
# /portal answers 503 portal_not_built).
set -euo pipefail
cd "$(dirname "$0")/../portal"
if ! command -v npm >/dev/null 2>&1; then
  if [[ "${1:-}" == "--optional" ]]; then
    echo "npm not found: the portal page is not built (the API runs without it)" >&2
    exit 0
  fi
  echo "npm not found: Node.js 20+ and npm are needed to build the portal" >&2
  exit 1
fi
if [[ ! -f node_modules/.installed || package-lock.json -nt node_modules/.installed ]]; then
  npm ci --no-audit --no-fund --loglevel=error
  touch node_modules/.installed
fi
npm run --silent build
