#!/usr/bin/env bash
# On a machine with a GPU, in one go (under 8 minutes on one H100: each step has its own cap
# and all of them share one deadline, GPU_CHECK_SECONDS, 450 by default): build the native
# engine in place (io_uring where liburing is found, else the thread pool), run
# tests/test_cuda.py (every placement of the host step against plain PyTorch on the GPU), then
# the GPU benchmark (bench/gpu_step.py: a 1.3 B-parameter bf16 GPT, resident, then AdamW state
# on "cpu", "cpu +grads" and "nvme"; the link's GB/s). Prints one summary; writes the log and
# the benchmark's JSON (rewritten after each row, so a step cut short keeps the rows before it)
# under $OUT when it is set. Installs nothing and fetches nothing: it needs torch, pytest,
# setuptools and pybind11 already there.
#
#   OUT=out PYTHON=.venv/bin/python bench/gpu_check.sh
#   bench/gpu_check.sh --dry-run   # no GPU needed: each step that runs without one, at once
#
# --dry-run skips the CUDA check, compiles the engine into a temporary folder (the checkout's
# build is left alone), runs tests/test_cuda.py (each test skips without a GPU) and the
# benchmark on the CPU at a tiny size. Without --dry-run and without a GPU it exits 2 at once.
set -uo pipefail
cd "$(dirname "$0")/.."
DRY=0
case "${1:-}" in
  --dry-run) DRY=1 ;;
  "") ;;
  *) echo "gpu_check: unknown argument $1 (the only one is --dry-run)"; exit 64 ;;
esac
PY=${PYTHON:-python3}
OUT=${OUT:-$(mktemp -d)}
LOG="$OUT/gpu_check.log"
END=$((SECONDS + ${GPU_CHECK_SECONDS:-450}))
exec > >(tee "$LOG") 2>&1

# The seconds a step may run: its cap, or what is left before the deadline if that is less.
left() { local r=$((END - SECONDS)); if [ "$r" -lt "$1" ]; then echo $((r > 1 ? r : 1)); else echo "$1"; fi; }

if [ "$DRY" = 0 ] &&
   ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu_check: no CUDA device here (torch.cuda.is_available() is False); nothing run"
  exit 2
fi
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'on',
torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU (dry run)')"
if [ "$DRY" = 0 ]; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # bench/gpu_step.py imports this checkout

echo "== build"
if [ "$DRY" = 1 ]; then
  BUILD=$(mktemp -d "${TMPDIR:-/tmp}/gpu-check-build-XXXXXX")
  timeout "$(left 180)" "$PY" setup.py -q build_ext --build-lib "$BUILD" --build-temp "$BUILD" ||
    { echo "gpu_check: build failed"; rm -rf "$BUILD"; exit 1; }
  rm -rf "$BUILD"
else
  timeout "$(left 180)" "$PY" setup.py -q build_ext --inplace ||
    { echo "gpu_check: build failed"; exit 1; }
fi
"$PY" -c "import tieroffload; from tieroffload import aio; print('tieroffload', tieroffload.__file__,
'backends', aio.backends())" || { echo "gpu_check: tieroffload does not import"; exit 1; }

echo "== tests/test_cuda.py"
timeout "$(left 150)" "$PY" -m pytest -q -p no:cacheprovider -o addopts="" tests/test_cuda.py
tests=$?

echo "== bench/gpu_step.py"
SCRATCH=$(mktemp -d "${TMPDIR:-/tmp}/gpu-check-XXXXXX")
df -hT "$SCRATCH" | tail -1  # the "NVMe" the bench writes to (a tmpfs reads as RAM speed)
if [ "$DRY" = 1 ]; then
  size=(--device cpu --layers 2 --d 64 --vocab 128 --seq 16 --batch 2 --steps 1)
else
  size=(--layers 24 --d 2048 --vocab 32000 --seq 1024 --batch 8 --steps 3)
fi
timeout "$(left 330)" "$PY" bench/gpu_step.py --dir "$SCRATCH" "${size[@]}" \
  --json "$OUT/gpu_step.json"
bench=$?
rm -rf "$SCRATCH"

echo "== summary: tests rc=$tests, bench rc=$bench (124: cut at the deadline) in ${SECONDS} s;" \
  "log $LOG, figures $OUT/gpu_step.json"
[ "$tests" = 0 ] && [ "$bench" = 0 ]
