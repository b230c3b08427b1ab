#!/usr/bin/env bash
# End to end on the GPU (gpu-check's e2e stage): the troupe binary built on the CPU machine, with
# its request, scheduler and executor actors, the executor on the CUDA device.
#   1. `troupe bench --concurrency 16` in process, --device cuda, then --device cpu (same model,
#      same machine): tokens/s and latencies as `name value unit` lines; then on the device at
#      Llama-3-8B's shapes with random weights (--load-format dummy), 64 streams (e2e_cuda_llama8b_*);
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
# bench DEV [TAG ARGS...]: JSON -> name value unit lines (e2e_{dev}[_TAG]_tok_s, ...); ARGS replace
# the model and the load (default: the model given, concurrency 16)
bench() {
  local dev=$1 tag=${2:-} line
  local args=(-m "$model" --concurrency 16 --requests 64)
  (($# > 2)) && args=("${@:3}")
  line=$("$troupe" bench "${args[@]}" --device "$dev" --prompt-len 128 --gen-len 64 -t "$threads" --json) ||
    { echo "e2e: bench --device $dev $tag failed"; rc=1; return; }
  echo "# bench $dev $tag: $line"
  python3 - "$dev" "$tag" "$line" <<'EOF'
import json, sys
dev, tag, d = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
for k, v in d.items():
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        print(f"e2e_{'cpu' if dev == 'cpu' else 'cuda'}{'_' + tag if tag else ''}_{k} {v}")
EOF
}
bench "$gpu"
bench cpu
# The serving runtime at Llama-3-8B's shapes: random bf16 weights generated on the device
# (--load-format dummy), 64 streams at once.
[[ $gpu == cuda ]] && bench "$gpu" llama8b -m llama-3-8b --load-format dummy --concurrency 64 --requests 128

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
