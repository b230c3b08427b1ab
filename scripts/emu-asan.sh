#!/usr/bin/env bash
# The CPU emulation of the CUDA tests (tests/cuda_emu) built with AddressSanitizer, in build-asan/:
# a kernel's access past the bytes cudaMalloc was asked for (the emulation poisons the rest of the
# 256-byte rounding), or outside any host buffer, stops the run with a report - memcheck for the
# kernels and host code that have run only in the emulation, never on a device under
# compute-sanitizer. Builds troupe_cuda_emu_tests alone (no service layers, no nvcc) and runs each
# test file of it as its own process, two at a time (nproc), longest first. Needs the set-up of
# scripts/setup.sh (the default model, for the engine tests). CI runs it after scripts/test.sh.
#
#   scripts/emu-asan.sh                 # every file: cuda_forward sampling attention quant ops cuda_emu
#   scripts/emu-asan.sh ops quant       # some of them
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${TROUPE_ASAN_BUILD_DIR:-$root/build-asan}
files=("$@")
((${#files[@]})) || files=(cuda_forward sampling attention quant ops cuda_emu)

cmake -S "$root" -B "$build" -G Ninja -DTROUPE_SERVICE=OFF -DTROUPE_CUDA=OFF -DCMAKE_BUILD_TYPE=Release \
  "-DCMAKE_CXX_FLAGS=-fsanitize=address -fno-omit-frame-pointer" -DCMAKE_EXE_LINKER_FLAGS=-fsanitize=address >/dev/null
ninja -C "$build" -j "$(nproc)" troupe_cuda_emu_tests

logs=$build/asan-logs
mkdir -p "$logs"
run_one() {  # FILE: 0 when it passed; its log in $logs/FILE.log
  local t0=$SECONDS rc=0
  "$build/tests/troupe_cuda_emu_tests" "-#" "[#$1.test]" >"$logs/$1.log" 2>&1 || rc=$?
  echo "emu-asan: $1: $([[ $rc == 0 ]] && echo passed || echo "FAILED (rc $rc)") in $((SECONDS - t0)) s"
  return $rc
}
export -f run_one
export build logs
if printf '%s\n' "${files[@]}" | xargs -P "$(nproc)" -I{} bash -c 'run_one {}'; then
  echo "emu-asan: every file passed (${files[*]})"
else
  for f in "${files[@]}"; do
    if ! grep -q "^All tests passed" "$logs/$f.log"; then
      echo "==== $f (last 60 lines of $logs/$f.log)"
      tail -60 "$logs/$f.log"
    fi
  done
  exit 1
fi
