#!/usr/bin/env bash
# GPU checks on one CUDA device, in a few minutes, installing nothing.
# Writes under $OUT: the GPU tests, the RMSNorm kernel table and the model step table.
#
#   OUT=/tmp/out bash benchmarks/gpu_check.sh
#
# It runs from the source tree: the package is staged in a temporary folder
# (passes/ copied in as boost_compile/passes) and put on PYTHONPATH.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-$(mktemp -d)}
DEVICE=${DEVICE:-cuda}
PRESET=${PRESET:-cola-350m}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
SRC=$(mktemp -d)
cp -r "$ROOT/boost_compile" "$SRC/boost_compile"
cp -r "$ROOT/passes" "$SRC/boost_compile/passes"
export PYTHONPATH="$SRC${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
cd "$ROOT"

{ nvidia-smi || true; $PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.cuda.is_available())"; } > "$OUT/machine.txt" 2>&1
echo "== GPU tests"
timeout 240 $PY -m pytest -q -m gpu -p no:cacheprovider tests/test_rmsnorm_kernel.py 2>&1 | tee "$OUT/gpu_tests.txt" | tail -5
echo "== RMSNorm forward+backward, bf16, 16384 rows"
timeout 150 $PY benchmarks/bench_rmsnorm_gpu.py --json "$OUT/rmsnorm.json" 2>&1 | tee "$OUT/rmsnorm.md"
echo "== model step, $PRESET"
timeout 240 $PY benchmarks/bench_single.py --device "$DEVICE" --dtype bfloat16 --presets "$PRESET" \
  --batch 4 --seq 1024 --vocab 0 --repeats 10 --warmup 3 --variants inductor group defaults 2>&1 \
  | grep -v -i warn | tee "$OUT/step.md"
