#!/usr/bin/env bash
# Installs everything the build, the tests and the demo need on a fresh Debian 12 machine:
# Debian packages (compiler, CMake, libraries) and a Python virtual environment in .venv with the
# Hugging Face packages the parity tests compare against. Safe to rerun: it skips what is present.
set -euo pipefail
cd "$(dirname "$0")/.."

packages=(build-essential cmake ninja-build pkg-config git python3 python3-venv
          libfmt-dev nlohmann-json3-dev libcli11-dev libgtest-dev libpcre2-dev libzstd-dev zstd
          libutf8proc-dev  # Unicode NFC for the tokenizers (data/unicode.cpp)
          libtomlplusplus-dev  # toml++, header-only: run configs (engine/run_config.cpp)
          openmpi-bin libopenmpi-dev  # mpirun and MPI for multi-process runs (src/parallel/)
          python3.11-doc)  # the demo corpus: real English text (tools/make_demo_corpus.sh)
missing=()
for p in "${packages[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing Debian packages: ${missing[*]}"
  sudo_cmd=""; [ "$(id -u)" -ne 0 ] && sudo_cmd="sudo"
  $sudo_cmd apt-get update -q
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -q "${missing[@]}"
fi

# Pinned so that parity results do not move under us; torch is only a test dependency, and so is
# tensorboard (its event reader checks the event files a run writes, tests/python/test_tensorboard.py).
python_packages="torch==2.15.0 transformers==5.24.0 tokenizers==0.23.3 safetensors==0.8.0 numpy==2.4.6 tensorboard==2.21.0"
stamp=.venv/marrow-packages
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$python_packages" ]; then
  echo "setup: creating .venv with $python_packages"
  python3 -m venv .venv
  .venv/bin/pip install -q --upgrade pip
  .venv/bin/pip install -q $python_packages
  echo "$python_packages" > "$stamp"
fi
# The cuDNN frontend (header-only C++ over cuDNN's graph API; ops/attention_cudnn.cpp) ships as headers
# inside its PyPI wheel: only the headers are kept, in .cache/cudnn-frontend/include.
frontend_version=1.16.0
frontend=.cache/cudnn-frontend
if [ "$(cat $frontend/version 2>/dev/null)" != "$frontend_version" ]; then
  echo "setup: fetching the cuDNN frontend $frontend_version headers"
  rm -rf $frontend && mkdir -p $frontend/wheel
  .venv/bin/pip download -q --no-deps --only-binary=:all: -d $frontend/wheel "nvidia-cudnn-frontend==$frontend_version"
  .venv/bin/python -c "import sys, zipfile; z = zipfile.ZipFile(sys.argv[1]); \
[z.extract(n, sys.argv[2]) for n in z.namelist() if n.startswith('include/')]" $frontend/wheel/*.whl $frontend
  rm -rf $frontend/wheel
  echo $frontend_version > $frontend/version
fi
echo "setup: done"
