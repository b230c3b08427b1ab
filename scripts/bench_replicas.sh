#!/usr/bin/env bash
# Data parallel over processes, same machine, same run, same client (load_tests/load_driver.py:
# N closed-loop SSE streams, prompt 128 / generation 128, greedy, ignore_eos, 2N requests, one
# warm-up):
#   troupe-1proc     one `troupe serve -t T`
#   troupe-dp2       a front `troupe serve -t T/2 --replica` + a replica `troupe serve -t T/2 --publish-port`
#                    (CAF middleman over loopback; the front routes each generation to the least loaded)
#   troupe-dp2-tls   the same over TLS both ways (--replica-tls-*: certificates of a CA made here)
#   llama-server     `llama-server -t T` (the peer; it has no multi-process data parallel)
# Prints one JSON line per system. LEVEL (16), THREADS (2), MODEL (models/default.gguf); PEER=0
# leaves llama-server out.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
n=${LEVEL:-16}
threads=${THREADS:-2}
half=$(( threads / 2 > 0 ? threads / 2 : 1 ))
bin=${TROUPE_BIN:-$root/build/troupe}
model=${MODEL:-$root/models/default.gguf}
py="$root/.venv/bin/python"
req=$(( 2 * n > 8 ? 2 * n : 8 ))
pids=()
trap 'for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done' EXIT

# start LOG ARGS...: runs `troupe serve ARGS` on a free port; prints the port.
start() {
  local log=$1; shift
  "$bin" serve --model "$model" --host 127.0.0.1 --port 0 --max-num-seqs "$n" --max-waiting 4096 "$@" >"$log" 2>&1 &
  pids+=($!)
  for _ in $(seq 1 600); do
    local port
    port=$(grep -oP 'listening on http://127\.0\.0\.1:\K[0-9]+' "$log" || true)
    [[ -n $port ]] && { echo "$port"; return; }
    sleep 0.1
  done
  cat "$log" >&2; exit 1
}
drive() { "$py" "$root/load_tests/load_driver.py" --url "http://127.0.0.1:$1" -c "$n" --prompt-len 128 --gen-len 128 \
  --requests "$req" --warmup 1 --json | tail -1; }
stop_all() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; wait "$p" 2>/dev/null || true; done; pids=(); }

logs=$(mktemp -d)
port=$(start "$logs/one.log" -t "$threads")
echo "troupe-1proc $(drive "$port")"
stop_all

# A CA and one certificate it signs (both processes use it) for the TLS run.
ssl() { openssl "$@" >/dev/null 2>&1; }
ssl req -x509 -newkey rsa:2048 -nodes -keyout "$logs/ca.key" -out "$logs/ca.pem" -days 1 -subj "/CN=bench CA"
ssl req -newkey rsa:2048 -nodes -keyout "$logs/peer.key" -out "$logs/peer.csr" -subj "/CN=peer"
ssl x509 -req -in "$logs/peer.csr" -CA "$logs/ca.pem" -CAkey "$logs/ca.key" -CAcreateserial -out "$logs/peer.pem" -days 1
tls=(--replica-tls-cert "$logs/peer.pem" --replica-tls-key "$logs/peer.key" --replica-tls-ca "$logs/ca.pem")

# dp2 NAME ARGS...: a replica and a front routing to it, both with ARGS.
dp2() {
  local name=$1; shift
  local pub port
  pub=$("$py" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
  start "$logs/replica.log" -t "$half" --publish-port "$pub" "$@" >/dev/null
  port=$(start "$logs/front.log" -t "$half" --replica "127.0.0.1:$pub" "$@")
  for _ in $(seq 1 100); do
    curl -s "http://127.0.0.1:$port/metrics" | grep -q "troupe_replica_up{model=\"default\",replica=\"127.0.0.1:$pub\"} 1" && break
    sleep 0.1
  done
  echo "$name $(drive "$port")"
  curl -s "http://127.0.0.1:$port/metrics" | grep '^troupe_replica_routed_total' >&2
  stop_all
}
dp2 troupe-dp2
dp2 troupe-dp2-tls "${tls[@]}"
rm -rf "$logs"
[[ ${PEER:-1} == 0 ]] && exit 0

server=$("$root/scripts/build_llama_server.sh" | tail -1)
"$py" "$root/load_tests/run_llama_server.py" --bin "$server" --gguf "$model" --concurrency "$n" --threads "$threads" \
  --prompt-len 128 --gen-len 128 --requests "$req" --warmup 1 --json | sed 's/^/llama-server /' | grep '^llama-server {'
