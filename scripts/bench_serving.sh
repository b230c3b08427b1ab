#!/usr/bin/env bash
# troupe's actor runtime vs llama.cpp's llama-server under the same closed-loop load, same GGUF,
# same machine, same run: N concurrent streams, prompt 128 / generation 128 tokens, greedy,
# max(2N, 8) requests per level. troupe is driven in process (`troupe bench --concurrency`; the
# HTTP server is a later step), llama-server over HTTP by load_tests/load_driver.py with -np N.
# Prints one JSON line per system and level.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
levels=${LEVELS:-1 4 16 64}
threads=${THREADS:-2}
bin=${TROUPE_BIN:-$root/build/troupe}
server=$("$root/scripts/build_llama_server.sh" | tail -1)
for n in $levels; do
  req=$(( 2 * n > 8 ? 2 * n : 8 ))
  echo "troupe $("$bin" bench --concurrency "$n" --requests "$req" --prompt-len 128 --gen-len 128 -t "$threads" --json)"
  "$root/.venv/bin/python" "$root/load_tests/run_llama_server.py" --bin "$server" --concurrency "$n" --threads "$threads" \
    --prompt-len 128 --gen-len 128 --requests "$req" --warmup 1 --json | sed 's/^/llama-server /' | grep '^llama-server {'
done
