#!/usr/bin/env bash
# Fills .gpu-carry/ (ignored through .git/info/exclude) with what the device machine's image lacks
# for scripts/gpu-check: the Debian packages the configure step needs (Catch2 v2, CLI11,
# nlohmann_json, toml++, utf8proc, and pkgconf in case the image has no pkg-config), laid out as
# one install prefix, plus a GGUF model for the GPU-vs-CPU whole-model tests, the generated test
# models, and the serving binary built here with the libraries it needs (end-to-end stage).
#
# The device tool carries at most 64 MiB per call, the working tree included, and
# models/default.gguf (SmolLM2-135M Q4_1) is about 94 MiB. So the carried model is that file cut
# to its first layers (every tensor byte-identical, llama.block_count lowered, tokenizer intact),
# as many layers as fit what the rest of the carry and the working tree leave (MODEL_BUDGET_MIB
# caps it lower; 5 layers on 2026-12-08, the CUDA module built on the device). The model is the same one
# on the device's CPU and GPU, so the comparison tests are as strict as with all 30 layers, only
# shallower.
#
#   scripts/prepare_gpu_carry.sh            then: run(command="scripts/gpu-check", carry=[".gpu-carry"])
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
carry="$root/.gpu-carry"
prefix="$carry/prefix"
python=${TROUPE_PYTHON:-$root/.venv/bin/python}

grep -qxF '/.gpu-carry/' "$root/.git/info/exclude" || echo '/.gpu-carry/' >>"$root/.git/info/exclude"
rm -rf "$carry"
mkdir -p "$prefix" "$carry/models"

# Every file of these packages except documentation, /usr stripped: prefix/{include,lib,share,bin}.
# The packages' CMake configs find their headers relative to themselves, so they work from there.
packages=(catch2 libcli11-dev nlohmann-json3-dev libtomlplusplus-dev libtomlplusplus3
          libutf8proc-dev libutf8proc2 pkgconf-bin libpkgconf3)
dpkg -L "${packages[@]}" |
  grep -E '^/usr/' | grep -vE '^/usr/share/(doc|man|lintian|doc-base|bash-completion|aclocal|Catch2)/|\.a$' |
  while read -r f; do [[ -f $f || -L $f ]] && echo "${f#/}"; done |
  tar -C / -cf - --no-recursion -T - | tar -C "$prefix" -xf - --strip-components=1
# Debian's Catch2 config lists its static main library; the tests do not use it, but the
# imported target must exist for find_package to succeed.
cp /usr/lib/libCatch2WithMain.a "$prefix/lib/"

# utf8proc is found through pkg-config: make its .pc relative to itself.
pcdir="$prefix/lib/x86_64-linux-gnu/pkgconfig"
sed -i 's|^prefix=.*|prefix=${pcfiledir}/../../..|' "$pcdir"/*.pc
# pkgconf wrapper for an image without pkg-config (gpu-check uses it only then).
cat >"$prefix/bin/pkg-config" <<'EOF'
#!/bin/sh
here=$(cd "$(dirname "$0")/.." && pwd)
LD_LIBRARY_PATH="$here/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" exec "$here/bin/pkgconf" "$@"
EOF
chmod +x "$prefix/bin/pkg-config"

# The generated models of the CUDA whole-model tests (quantized GEMV, qwen2, f32, Gemma 3): the device has
# no `gguf` package to make them. ~6.6 MB, carried gzipped.
mkdir -p "$carry/stage/tests/fixtures/generated"
for preset in llama_q4_k llama_q4_k_m qwen2_q6_k_gqa4 llama_f32_hd64 gemma3_bf16_hd256; do
  "$python" "$root/scripts/gen_tiny_model.py" --preset "$preset" "$carry/stage/tests/fixtures/generated/$preset.gguf" >/dev/null
done
tar -C "$carry/stage" -czf "$carry/fixtures.tar.gz" tests
rm -rf "$carry/stage"

# The serving binary built here (troupe with CAF, Boost and the CUDA backend; the device image
# has no CAF or Boost to build it there) and the libraries the image lacks, for gpu-check's
# end-to-end stage (scripts/gpu-e2e.sh): the executor actor on the GPU behind the real scheduler.
# Off with SERVE_BIN=none; the build must have found nvcc (TROUPE_HAVE_CUDA).
serve_bin=${SERVE_BIN:-$root/build/troupe}
if [[ $serve_bin != none ]]; then
  [[ -x $serve_bin ]] || { echo "no $serve_bin: build first (scripts/test.sh) or set SERVE_BIN=none" >&2; exit 1; }
  mkdir -p "$carry/stage/bin" "$carry/stage/lib"
  cp "$serve_bin" "$carry/stage/bin/troupe"
  # Its CUDA backend, the module it loads from beside itself for --device cuda, is built on the
  # device by gpu-check (the same sources; 18 MB here, which the carry cannot spare beside a model
  # of more than a layer or two). CARRY_MODULE=1 carries this build's instead.
  if [[ ${CARRY_MODULE:-0} == 1 ]]; then
    module="$(dirname "$serve_bin")/libtroupe_cuda.so"
    [[ -f $module ]] || { echo "no $module: the build did not find nvcc" >&2; exit 1; }
    cp "$module" "$carry/stage/bin/"
  fi
  # Every non-system library it links except CUDA's (the image has its own CUDA 13).
  ldd "$serve_bin" | awk '$3 ~ /^\// {print $3}' |
    grep -vE '/(libc|libm|libdl|librt|libpthread|libgcc_s|libstdc\+\+|ld-linux[^/]*)\.so|/cuda/' |
    while read -r lib; do cp -L "$lib" "$carry/stage/lib/"; done
  tar -C "$carry/stage" -czf "$carry/serve.tar.gz" bin lib
  rm -rf "$carry/stage"
  tar -tzf "$carry/serve.tar.gz" | sed 's/^/serve: /'
fi

# The model, last: a real copy, cut to the layers that fit what the rest leaves of the 64 MiB
# (less 1 MiB; MODEL_BUDGET_MIB caps it lower).
tree=$(git -C "$root" ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
rest=$(du -sb "$carry" | cut -f1)
fit_kib=$(( (64 * 1048576 - tree - rest) / 1024 - 1024 ))
budget_kib=$(( ${MODEL_BUDGET_MIB:-65536} * 1024 ))
((budget_kib > fit_kib)) && budget_kib=$fit_kib
echo "model budget: $budget_kib KiB (the rest of the carry $rest bytes, working tree $tree)"
src=$(readlink -f "$root/models/default.gguf")
"$python" "$root/scripts/cut_model.py" "$src" "$carry/models/default.gguf" --budget-kib "$budget_kib"

du -sh "$prefix" "$carry/models/default.gguf" "$carry"/*.tar.gz
total=$(du -sb "$carry" | cut -f1)
echo "total: $total bytes ($(du -sh "$carry" | cut -f1)) + working tree $tree; the device tool's limit is 64 MiB for both"
if ((total + tree > 64 * 1048576)); then
  echo "over the limit: lower MODEL_BUDGET_MIB" >&2
  exit 1
fi
