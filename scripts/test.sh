#!/usr/bin/env bash
# Sets up (idempotent), builds, and runs the whole test suite (C++ unit tests and the Python
# reference tests) through ctest. Benchmarks are tagged and not run.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/scripts/setup.sh"
"$root/scripts/build.sh"
cd "${TROUPE_BUILD_DIR:-$root/build}"
ctest --output-on-failure -j "$(nproc)" "$@"
