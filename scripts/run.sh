#!/usr/bin/env bash
# Sets up (idempotent), builds, and runs `troupe` with the given arguments.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/scripts/setup.sh"
"$root/scripts/build.sh" >/dev/null
exec "${TROUPE_BUILD_DIR:-$root/build}/troupe" "$@"
