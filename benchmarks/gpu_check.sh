#!/usr/bin/env bash
# GPU checks on one CUDA device, in a few minutes, installing nothing.
# Writes under $OUT: the GPU tests, the RMSNorm kernel table and boost-bench single (dense and
# CoLA, eager / Inductor / boost) in bf16.
#
#   OUT=/tmp/out bash benchmarks/gpu_check.sh
#
# It runs from the source tree: the package is staged in a temporary folder
# (passes/ copied in as boost_compile/passes) and put on PYTHONPATH.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-$(mktemp -d)}
DEVICE=${DEVICE:-cuda}
SIZE=${SIZE:-350m}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
SRC=$(mktemp -d)
cp -r "$ROOT/boost_compile" "$SRC/boost_compile"
cp -r "$ROOT/passes" "$SRC/boost_compile/passes"
export PYTHONPATH="$SRC${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
cd "$ROOT"

{ nvidia-smi || true; $PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.cuda.is_available())"; } > "$OUT/machine.txt" 2>&1
echo "== GPU tests"
timeout 240 $PY -m pytest -q -n 0 -m gpu -p no:cacheprovider tests/unit/test_rmsnorm_kernel.py 2>&1 | tee "$OUT/gpu_tests.txt" | tail -5
echo "== RMSNorm forward+backward, bf16, 16384 rows"
timeout 150 $PY benchmarks/bench_rmsnorm_gpu.py --json "$OUT/rmsnorm.json" 2>&1 | tee "$OUT/rmsnorm.md"
echo "== model step, $SIZE"
timeout 300 $PY -m boost_compile.bench single --device "$DEVICE" --dtype bfloat16 --size "$SIZE" \
  --batch 4 --seq 1024 --vocab 0 --repeats 10 --warmup 3 --threads 0 --clock wall \
  --variants dense-eager dense-inductor cola-inductor cola-group cola-boost --out "$OUT/results" 2>&1 \
  | grep -v -i warn | tee "$OUT/step.md"
