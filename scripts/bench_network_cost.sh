#!/usr/bin/env bash
# The cost of troupe's network layer: the same closed-loop workload (1 stream, random token-id
# prompts, greedy, ignore_eos) through the in-process engine handle (`troupe bench --concurrency 1`)
# and through `troupe serve` over loopback HTTP + SSE (load_tests/load_driver.py --token-ids),
# alternated ROUNDS times. On a tiny generated model (scripts/gen_tiny_model.py) compute is a
# fraction of a millisecond, so the TTFT / ITL difference is the HTTP, SSE, JSON and client cost.
#
#   scripts/bench_network_cost.sh [MODEL.gguf] [ROUNDS] [REQUESTS]
# Prints one JSON line per run, then the medians over rounds.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
ROUNDS=${2:-5}
REQUESTS=${3:-300}
MODEL=${1:-}
if [[ -z "$MODEL" ]]; then
  MODEL=$(mktemp -d)/tiny_q8_0.gguf
  $PY scripts/gen_tiny_model.py "$MODEL" --preset llama_q8_0 >/dev/null
fi
NV=$($PY -c "import sys; from gguf import GGUFReader; print(len(GGUFReader(sys.argv[1]).fields['tokenizer.ggml.tokens'].data))" "$MODEL")
PORT=$($PY -c "import socket; s=socket.socket(); s.bind(('127.0.0.1',0)); print(s.getsockname()[1])")
SHAPE=(--prompt-len 32 --gen-len 32)

build/troupe serve -m "$MODEL" --port "$PORT" -t 1 >/tmp/troupe_netcost_serve.log 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null; wait $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 100); do curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break; sleep 0.1; done

OUT=$(mktemp)
for r in $(seq "$ROUNDS"); do
  echo "{\"path\":\"inproc\",$(build/troupe bench -m "$MODEL" --concurrency 1 --requests "$REQUESTS" "${SHAPE[@]}" -t 1 --json 2>/dev/null | tail -1 | cut -c2-)" | tee -a "$OUT"
  echo "{\"path\":\"http\",$($PY load_tests/load_driver.py --url "http://127.0.0.1:$PORT" -c 1 "${SHAPE[@]}" --requests "$REQUESTS" \
        --warmup 5 --seed "$r" --token-ids "$NV" --json 2>/dev/null | tail -1 | cut -c2-)" | tee -a "$OUT"
done
$PY - "$OUT" <<'PYEOF'
import json, statistics, sys
runs = [json.loads(l) for l in open(sys.argv[1])]
def med(path, key):
    return statistics.median(r[key] for r in runs if r["path"] == path)
print(f"{'metric':<14}{'in-process':>12}{'HTTP+SSE':>12}{'added':>10}   (medians of {len(runs) // 2} rounds, ms)")
for k in ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "e2e_p50_ms"):
    a, b = med("inproc", k), med("http", k)
    print(f"{k:<14}{a:>12.3f}{b:>12.3f}{b - a:>+10.3f}")
PYEOF
