#!/usr/bin/env bash
# The CPU emulation of the CUDA tests (tests/cuda_emu) built with AddressSanitizer, in build-asan/:
# a kernel's access past the bytes cudaMalloc was asked for (the emulation poisons the rest of the
# 256-byte rounding), or outside any host buffer, stops the run with a report - memcheck for the
# kernels and host code that have run only in the emulation, never on a device under
# compute-sanitizer. Builds troupe_cuda_emu_tests alone (no service layers, no nvcc) and runs its
# test files through ctest, nproc at a time. Needs the set-up of scripts/setup.sh (the default
# model, which the build cuts to 8 layers for the engine tests). CI runs it after scripts/test.sh.
#
#   scripts/emu-asan.sh                 # the kernel files: sampling attention quant ops errors, the
#                                       # lone sticky-fault case, cuda_emu (~10 min)
#   scripts/emu-asan.sh cuda_forward    # the engine's forward pass too: over 20 min alone, so not by default
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${TROUPE_ASAN_BUILD_DIR:-$root/build-asan}
files=("$@")
((${#files[@]})) || files=(sampling attention quant ops errors sticky_error cuda_emu)

# TROUPE_EMU_ASAN: the emulation and what it runs instrumented, not the CPU reference (tests/CMakeLists.txt).
cmake -S "$root" -B "$build" -G Ninja -DTROUPE_SERVICE=OFF -DTROUPE_CUDA=OFF -DCMAKE_BUILD_TYPE=Release \
  -DTROUPE_EMU_ASAN=ON >/dev/null
ninja -C "$build" -j "$(nproc)" troupe_cuda_emu_tests

# ctest runs each file as cuda_emu.FILE with the environment the emulated tests need (the
# whole-model tests read the default model cut to 8 layers, build-asan/tests/cuda_emu/source).
regex="^cuda_emu\.($(IFS='|'; echo "${files[*]}"))\$"
ctest --test-dir "$build" -R "$regex" -j "$(nproc)" --output-on-failure --timeout 3600
