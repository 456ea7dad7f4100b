#!/usr/bin/env bash
# GPU checks on one CUDA device, in a few minutes, installing nothing.
# Writes under $OUT, in this order (the most telling first, for a lease that runs out): the GPU
# tests (boost-compiled dense, CoLA, LaX and Hugging Face Llama against eager in fp32 and bf16,
# checkpoint none and lowrank, a 20-step boost-train run, the RMSNorm kernels), the RMSNorm
# kernel table and boost-bench single (dense and CoLA, eager / Inductor / boost) in bf16.
# boost-train needs hydra-core and omegaconf, which the GPU machine may lack: put their wheels
# on PYTHONPATH first.
#
#   OUT=/tmp/out bash benchmarks/gpu_check.sh
#
# It runs from the source tree: the package is staged in a temporary folder
# (passes/ and hydra_conf/ copied in as a wheel has them) and put on PYTHONPATH; PYTHONSAFEPATH=1 keeps the
# working folder off sys.path (in pytest's workers and subprocesses too), so the checkout's own
# boost_compile/ (which lacks passes/) never shadows the staged one.
# DEVICE=cpu runs the GPU tests on the CPU (a dry run); WORKERS sets pytest's processes.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-$(mktemp -d)}
DEVICE=${DEVICE:-cuda}
SIZE=${SIZE:-350m}
PY=${PYTHON:-python3}
# per-section limits in seconds, shorter where a lease has little device time left
WORKERS=${WORKERS:-4}
T_TESTS=${T_TESTS:-240} T_NORM=${T_NORM:-150} T_STEP=${T_STEP:-300}
mkdir -p "$OUT"
SRC=$(mktemp -d)
cp -r "$ROOT/boost_compile" "$SRC/boost_compile"
cp -r "$ROOT/passes" "$SRC/boost_compile/passes"
cp -r "$ROOT/hydra_conf" "$SRC/boost_compile/hydra_conf"  # boost-train's configs, as in a wheel
export PYTHONPATH="$SRC${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 BOOST_TEST_DEVICE="$DEVICE" \
  PYTHONSAFEPATH=1
cd "$ROOT"

{ nvidia-smi || true; $PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.cuda.is_available())"; } > "$OUT/machine.txt" 2>&1
echo "== GPU tests"
timeout $T_TESTS $PY -m pytest -q -n "$WORKERS" -m gpu -p no:cacheprovider --durations=10 \
  tests/unit/test_gpu_parity.py tests/unit/test_rmsnorm_kernel.py 2>&1 | tee "$OUT/gpu_tests.txt" | tail -25
echo "== RMSNorm forward+backward, bf16, 16384 rows"
timeout $T_NORM $PY benchmarks/bench_rmsnorm_gpu.py --json "$OUT/rmsnorm.json" 2>&1 | tee "$OUT/rmsnorm.md"
echo "== model step, $SIZE"
timeout $T_STEP $PY -m boost_compile.bench single --device "$DEVICE" --dtype bfloat16 --size "$SIZE" \
  --batch 4 --seq 1024 --vocab 0 --repeats 10 --warmup 3 --threads 0 --clock wall \
  --variants dense-eager dense-inductor cola-inductor cola-group cola-boost --out "$OUT/results" 2>&1 \
  | grep -v -i warn | tee "$OUT/step.md"
