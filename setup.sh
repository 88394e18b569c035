#!/usr/bin/env bash
# Sets tieroffload up in ./.venv: torch (a CPU build where there is no GPU), the native engine
# (with io_uring where liburing is found), and the test tools. Safe to run again: it only does
# what is missing.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}

if [ ! -f /usr/include/liburing.h ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "setup: installing liburing-dev for the io_uring backend"
    apt-get install -y -qq liburing-dev >/dev/null 2>&1 ||
      { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq liburing-dev >/dev/null 2>&1; } ||
      echo "setup: could not install liburing-dev; building with the thread-pool backend only"
  else
    echo "setup: liburing-dev is missing (apt-get install liburing-dev as root for io_uring);" \
         "building with the thread-pool backend only"
  fi
fi

if [ ! -x .venv/bin/python ]; then
  if ! "$PY" -m venv --system-site-packages .venv 2>/dev/null; then
    rm -rf .venv  # Debian's python3 needs python3-venv for this
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
      echo "setup: installing python3-venv"
      apt-get install -y -qq python3-venv >/dev/null 2>&1 ||
        { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq python3-venv >/dev/null; }
    fi
    "$PY" -m venv --system-site-packages .venv ||
      { echo "setup: cannot create a virtual environment (apt-get install python3-venv)"; exit 1; }
  fi
fi
pip=(.venv/bin/python -m pip install -q --disable-pip-version-check)

if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
    echo "setup: GPU found, installing torch (CUDA build)"
    "${pip[@]}" torch
  else
    echo "setup: no GPU, installing torch 2.13.0 (CPU build, from pip's configured index)"
    "${pip[@]}" torch==2.13.0
  fi
fi

stamp=$(cat setup.py pyproject.toml native/* | sha1sum | cut -d' ' -f1)
if [ "$(cat .venv/.tieroffload-build 2>/dev/null)" != "$stamp" ] ||
   ! .venv/bin/python -c "import tieroffload._native" 2>/dev/null; then
  echo "setup: building tieroffload"
  "${pip[@]}" "setuptools>=64" wheel "pybind11>=2.11"
  "${pip[@]}" --no-build-isolation -e ".[test]"
  echo "$stamp" > .venv/.tieroffload-build
fi
