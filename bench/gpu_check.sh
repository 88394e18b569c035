#!/usr/bin/env bash
# On a machine with a GPU, in one go (under 8 minutes on one H200): build the native engine,
# run tests/test_cuda.py (every placement of the host step against plain PyTorch on the GPU),
# then the GPU benchmark (bench/gpu_step.py: a 1.3 B-parameter bf16 GPT, AdamW state on "cpu"
# and on "nvme", beside the same model resident, and the link's GB/s). Prints one summary;
# writes the log and the benchmark's JSON under $OUT when it is set.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-$(mktemp -d)}
LOG="$OUT/gpu_check.log"
exec > >(tee "$LOG") 2>&1

if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu_check: no CUDA device here (torch.cuda.is_available() is False); nothing run"
  exit 2
fi
"$PY" -c "import torch; print('torch', torch.__version__, 'on', torch.cuda.get_device_name())"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true

echo "== build"
"$PY" -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 ||
  "$PY" setup.py build_ext --inplace -q || { echo "gpu_check: build failed"; exit 1; }

echo "== tests/test_cuda.py"
timeout 240 "$PY" -m pytest -q -p no:cacheprovider tests/test_cuda.py
tests=$?

echo "== bench/gpu_step.py"
SCRATCH=$(mktemp -d "${TMPDIR:-/tmp}/gpu-check-XXXXXX")
timeout 300 "$PY" bench/gpu_step.py --dir "$SCRATCH" --layers 24 --d 2048 --vocab 32000 \
  --seq 1024 --batch 8 --steps 3 --json "$OUT/gpu_step.json"
bench=$?
rm -rf "$SCRATCH"

echo "== summary: tests rc=$tests, bench rc=$bench; log $LOG, figures $OUT/gpu_step.json"
[ "$tests" = 0 ] && [ "$bench" = 0 ]
