#!/usr/bin/env bash
# Run THERE (a lent GPU machine), from the repository root, with `.device` carried
# (benchmarks/device/prepare.sh made it):
#   bash benchmarks/device/run.sh tests      # the kernel + CUDA-path tests compiled for the GPU
#   bash benchmarks/device/run.sh kernels    # bandwidth and each kernel against its ceiling
#   bash benchmarks/device/run.sh engine     # Llama-3-8B shape: batch-1 bound, 64/256 seqs, HF
#   bash benchmarks/device/run.sh parallel   # TP=8 Llama-3-70B terms: a rank's matmuls, NCCL
#                                            # all-reduce across the visible GPUs (2 or more)
#   bash benchmarks/device/run.sh check      # tests, kernels and engine in one call, each under
#                                            # its own time limit (about 9 minutes in all)
# Each step fits one 10-minute call; results land in $OUT (or benchmarks/results).
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-benchmarks/results}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 SHOAL_TEST_TOKENIZER_DIR=$PWD/.device/tokenizer
# Our package and the wheels prepare.sh fetched, no deps: the image's torch/triton/transformers
# must stay as they are.
python3 -m pip install -q --no-deps --no-index .device/whl/*.whl >/dev/null
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
case "${1:-all}" in
  tests)
    python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/unit/kernels_triton \
      2>&1 | tee "$out/gpu_tests.log" ;;
  kernels)
    python3 -m benchmarks.gpu_kernels --skip-engine --out "$out/gpu_kernels.json" ;;
  engine)
    python3 -m benchmarks.gpu_kernels --skip-kernels --out "$out/gpu_engine.json" ;;
  parallel)
    python3 benchmarks/device/parallel_tp.py --out "$out/parallel_tp.json" ;;
  all)
    python3 -m benchmarks.gpu_kernels --out "$out/gpu_all.json" ;;
  check)  # one lent call: a step that runs out of its limit is cut, the next still runs
    rc=0
    timeout 360 python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/unit/kernels_triton \
      2>&1 | tee "$out/gpu_tests.log" || rc=1
    timeout 90 python3 -m benchmarks.gpu_kernels --skip-engine --out "$out/gpu_kernels.json" \
      2>&1 | tail -40 || rc=1
    timeout 120 python3 -m benchmarks.gpu_kernels --skip-kernels --skip-transformers \
      --out "$out/gpu_engine.json" 2>&1 | tail -40 || rc=1
    exit $rc ;;
  *) echo "usage: $0 tests|kernels|engine|parallel|all|check" >&2; exit 2 ;;
esac
