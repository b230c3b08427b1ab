#!/usr/bin/env bash
# End to end on the GPU (gpu-check's e2e stage): the troupe binary built on the CPU machine, with
# its request, scheduler and executor actors, the executor on the CUDA device.
#   1. `troupe bench --concurrency 16` in process, --device cuda, then --device cpu (same model,
#      same machine): tokens/s and latencies as `name value unit` lines;
#   2. `--device cuda:7` refused at start with one line naming it;
#   3. a GPU server and a CPU server over HTTP, compared by scripts/gpu_e2e_client.py (greedy
#      prefixes, a seeded request sampled on the device twice, a logprobs request, two hot
#      reloads of the GPU server: same greedy output after, every replaced executor unloaded).
#
#   scripts/gpu-e2e.sh SERVE_DIR MODEL        (SERVE_DIR holds bin/troupe and lib/)
# Every server is stopped on exit. Exit status: the first failure's.
set -uo pipefail
dir=$1 model=$2
troupe=$dir/bin/troupe
threads=${E2E_THREADS:-$(nproc)}
gpu=${E2E_DEVICE:-cuda}  # E2E_DEVICE=cpu: a dry run of this script on a machine without a GPU
cuda_libs=$(ls -d /usr/local/cuda/lib64 /usr/local/cuda/lib /usr/local/cuda/targets/x86_64-linux/lib 2>/dev/null | paste -sd:)
export LD_LIBRARY_PATH=$dir/lib${cuda_libs:+:$cuda_libs}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
if ldd "$troupe" | grep 'not found'; then
  echo "e2e: the carried binary misses libraries on this image"
  exit 3
fi
"$troupe" --version || exit 3

rc=0
# bench JSON -> name value unit lines (e2e_{dev}_tokens_per_s, ...)
bench() {
  local dev=$1 line
  line=$("$troupe" bench -m "$model" --device "$dev" --concurrency 16 --requests 64 --prompt-len 128 \
    --gen-len 64 -t "$threads" --json) || { echo "e2e: bench --device $dev failed"; rc=1; return; }
  echo "# bench $dev: $line"
  python3 - "$dev" "$line" <<'EOF'
import json, sys
dev, d = sys.argv[1], json.loads(sys.argv[2])
for k, v in d.items():
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        print(f"e2e_{'cpu' if dev == 'cpu' else 'cuda'}_{k} {v}")
EOF
}
bench "$gpu"
bench cpu

# A device index the machine lacks: refused at start with one line naming it.
bad=$(timeout 60 "$troupe" serve -m "$model" --device cuda:7 --port 0 2>&1 | tail -1)
echo "# --device cuda:7: $bad"
if [[ $gpu != cuda || $bad == *"no CUDA device 7"* ]]; then echo "check bad_device ok"; else echo "check bad_device FAIL"; rc=1; fi

pids=()
trap 'kill "${pids[@]}" 2>/dev/null; wait 2>/dev/null' EXIT
"$troupe" serve -m "$model" --device "$gpu" --port 18080 -t "$threads" >/tmp/e2e-serve-gpu.log 2>&1 &
pids+=($!)
"$troupe" serve -m "$model" --port 18081 -t "$threads" >/tmp/e2e-serve-cpu.log 2>&1 &
pids+=($!)
python3 "$(dirname "$0")/gpu_e2e_client.py" --gpu http://127.0.0.1:18080 --cpu http://127.0.0.1:18081 || rc=1
for f in /tmp/e2e-serve-{gpu,cpu}.log; do echo "# tail of $f"; tail -5 "$f"; done
exit $rc
