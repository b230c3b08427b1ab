#!/usr/bin/env bash
# troupe serve vs llama-server, both over loopback HTTP + SSE with the same client
# (load_tests/load_driver.py), same GGUF, same run: N concurrent closed-loop streams, prompt 128 /
# generation 128 tokens, greedy, ignore_eos, max(2N, 8) requests and one warm-up per level. Each
# level starts a fresh server (no prefix cache carried over; the driver's prompts repeat across runs).
# Prints one JSON line per system and level.
# TROUPE_VARIANTS: ';'-separated extra `troupe serve` arguments, one troupe run per variant and
# level (e.g. TROUPE_VARIANTS=";--target-itl-ms 100" runs the defaults, then the ITL target).
# MODEL: the GGUF both serve (default: models/default.gguf).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
levels=${LEVELS:-1 4 16 64}
threads=${THREADS:-2}
bin=${TROUPE_BIN:-$root/build/troupe}
model=${MODEL:-$root/models/default.gguf}
py="$root/.venv/bin/python"
server=$("$root/scripts/build_llama_server.sh" | tail -1)
IFS=';' read -r -a variants <<< "${TROUPE_VARIANTS:-}"
[[ ${#variants[@]} -gt 0 ]] || variants=("")
for n in $levels; do
  req=$(( 2 * n > 8 ? 2 * n : 8 ))
  for variant in "${variants[@]}"; do
    log=$(mktemp)
    # shellcheck disable=SC2086  # a variant is a list of arguments
    "$bin" serve --model "$model" --host 127.0.0.1 --port 0 -t "$threads" --max-num-seqs "$n" --max-waiting 4096 $variant >"$log" 2>&1 &
    pid=$!
    trap 'kill $pid 2>/dev/null || true' EXIT
    port=""
    for _ in $(seq 1 600); do
      port=$(grep -oP 'listening on http://127\.0\.0\.1:\K[0-9]+' "$log" || true)
      [[ -n $port ]] && break
      sleep 0.1
  done
  [[ -n $port ]] || { cat "$log" >&2; exit 1; }
  echo "troupe-http${variant:+[$variant]} $("$py" "$root/load_tests/load_driver.py" --url "http://127.0.0.1:$port" -c "$n" \
    --prompt-len 128 --gen-len 128 --requests "$req" --warmup 1 --json | tail -1)"
  kill "$pid"; wait "$pid" 2>/dev/null || true
  rm -f "$log"
  done
  "$py" "$root/load_tests/run_llama_server.py" --bin "$server" --gguf "$model" --concurrency "$n" --threads "$threads" \
    --prompt-len 128 --gen-len 128 --requests "$req" --warmup 1 --json | sed 's/^/llama-server /' | grep '^llama-server {'
done
