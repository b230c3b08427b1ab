#!/usr/bin/env bash
# Builds llama.cpp's C++ server (llama-server), the benchmark peer, for this CPU from the llama.cpp
# sources vendored in the llama-cpp-python sdist (same version as the reference in .venv), into
# build-peer/. Idempotent: does nothing but print the path when the binary already exists.
# Prints the path of llama-server on the last line of stdout.
#
# Environment: TROUPE_PEER_DIR (default <repo>/build-peer), TROUPE_PEER_JOBS (default 2),
#              PYTHON (the pip to download with; default <repo>/.venv/bin/python, else python3).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
peer=${TROUPE_PEER_DIR:-$root/build-peer}
jobs=${TROUPE_PEER_JOBS:-2}
version=0.3.36
bin="$peer/build/bin/llama-server"

if [[ -x $bin ]]; then
  echo "$bin"
  exit 0
fi

py=${PYTHON:-$root/.venv/bin/python}
[[ -x $py ]] || py=python3

# 1. The sdist, downloaded once (no binaries: we want the sources).
src_root="$peer/src/llama_cpp_python-$version"
llama_src="$src_root/vendor/llama.cpp"
if [[ ! -f $llama_src/CMakeLists.txt ]]; then
  mkdir -p "$peer/src"
  sdist="$peer/src/llama_cpp_python-$version.tar.gz"
  if [[ ! -f $sdist ]]; then
    echo "build_llama_server: downloading llama-cpp-python==$version sdist" >&2
    "$py" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$version" -d "$peer/src" >&2
  fi
  tar -xzf "$sdist" -C "$peer/src"
  [[ -f $llama_src/CMakeLists.txt ]] || { echo "build_llama_server: no vendor/llama.cpp in $sdist" >&2; exit 1; }
fi

# 2. Configure. In this llama.cpp version LLAMA_CURL is deprecated (no effect but a warning), the
# server lives under tools/ (needs LLAMA_BUILD_TOOLS), HTTPS needs OpenSSL (off: loopback only), and
# the web UI would be fetched from a Hugging Face bucket unless LLAMA_USE_PREBUILT_UI=OFF.
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
if [[ ! -f $peer/build/CMakeCache.txt ]]; then
  cmake -S "$llama_src" -B "$peer/build" "${generator[@]}" \
    -DCMAKE_BUILD_TYPE=Release \
    -DGGML_NATIVE=ON \
    -DBUILD_SHARED_LIBS=OFF \
    -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_COMMON=ON \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF \
    -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
    -DLLAMA_OPENSSL=OFF >&2
fi

# 3. Build only the server target.
start=$(date +%s)
cmake --build "$peer/build" --target llama-server -j "$jobs" >&2
echo "build_llama_server: built in $(( $(date +%s) - start )) s" >&2
[[ -x $bin ]] || { echo "build_llama_server: $bin was not produced" >&2; exit 1; }
echo "$bin"
