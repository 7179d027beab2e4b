#!/usr/bin/env bash
# Run THERE (a lent GPU machine), from the repository root, with `.device` carried
# (benchmarks/device/prepare.sh made it):
#   bash benchmarks/device/run.sh tests      # the kernel + CUDA-path tests compiled for the GPU
#   bash benchmarks/device/run.sh kernels    # bandwidth and each kernel against its ceiling
#   bash benchmarks/device/run.sh engine     # Llama-3-8B shape: batch-1 bound, 64/256 seqs, HF
#   bash benchmarks/device/run.sh parallel   # TP=8 Llama-3-70B terms: a rank's matmuls, NCCL
#                                            # all-reduce across the visible GPUs (2 or more)
#   bash benchmarks/device/run.sh parity     # the whole device parity matrix (~6 minutes)
#   bash benchmarks/device/run.sh check      # kernel tests, quick parity, kernels and engine in
#                                            # one call, each under its own limit (~9 minutes)
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
PYTEST="python3 -m pytest -q -p no:cacheprovider -o addopts= -rfE --tb=short"
PARITY=tests/unit/kernels_triton/test_device_parity.py
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
  parity)  # every family x bf16/fp16 x graphs+prefix on/off (52 cases, ~7 s each)
    $PYTEST $PARITY 2>&1 | tee "$out/gpu_parity.log" ;;
  check)  # one lent call (~9 min): a step that runs out of its limit is interrupted (SIGINT, so
    # pytest still prints what failed so far) and the next still runs
    rc=0
    timeout -s INT -k 15 200 $PYTEST tests/unit/kernels_triton --deselect $PARITY 2>&1 \
      | tee "$out/gpu_tests.log" || rc=1
    SHOAL_DEVICE_PARITY=quick timeout -s INT -k 15 130 $PYTEST $PARITY 2>&1 \
      | tee "$out/gpu_parity.log" || rc=1
    timeout 60 python3 -m benchmarks.gpu_kernels --skip-engine --out "$out/gpu_kernels.json" \
      2>&1 | tail -40 || rc=1
    timeout 150 python3 -m benchmarks.gpu_kernels --skip-kernels --skip-transformers \
      --out "$out/gpu_engine.json" 2>&1 | tail -40 || rc=1
    exit $rc ;;
  *) echo "usage: $0 tests|parity|kernels|engine|parallel|all|check" >&2; exit 2 ;;
esac
