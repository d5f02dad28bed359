#!/usr/bin/env bash
# The GPU checks in one go, for a machine with one or more CUDA devices (CI has none):
# the tests marked gpu, then the GPU benchmarks. Logs go to $OUT (default /tmp/gpu_check).
#
#     bash bench/gpu_check.sh [SIZE_MIB] [quick]
#
# With ``quick``: the tests, the 1x staging run and the profiles of a synchronous save
# only (no 4x run, no memory run).
# Uses the python3 on the PATH with its own torch; the package is used from this checkout.
set -u
OUT=${OUT:-/tmp/gpu_check}
SIZE=${1:-1024}
QUICK=${2:-}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD:$PWD/bench${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
GPUS=$(python3 -c "import torch; print(torch.cuda.device_count())")
{
    nvidia-smi -L
    python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
    nproc
    df -h "${TMPDIR:-/tmp}" | tail -1
} 2>&1 | tee "$OUT/machine.log"

timeout 170 python3 -m pytest -q -ra -p no:cacheprovider -m gpu \
    tests/multirank/test_cuda_paths.py tests/multirank/test_staging_memory.py \
    tests/multirank/test_filesystem_async.py tests/multirank/test_harness.py \
    tests/multirank/test_tensor_aware_state_dict.py tests/unit/test_staging_pool.py \
    2>&1 | tee "$OUT/gpu_tests.log"

timeout 150 torchrun --standalone --nproc_per_node="$GPUS" bench/gpu_staging.py \
    --size-mib "$SIZE" --repeats 2 --saves 3 2>&1 | tee "$OUT/gpu_staging.log"

# Where a synchronous save of CUDA state spends the caller's time, per layout.
for layout in torch_dist raw_bytes; do
    timeout 60 torchrun --standalone --nproc_per_node=1 bench/profile_save.py --device cuda \
        --layout "$layout" --size-mib "$SIZE" --top 25 2>&1 | tee "$OUT/profile_$layout.log"
done
[ "$QUICK" = quick ] && exit 0

# Scaling: four times the state, the persistent caller only (blocked time against the copy).
timeout 150 torchrun --standalone --nproc_per_node="$GPUS" bench/gpu_staging.py \
    --size-mib $((4 * SIZE)) --repeats 1 --saves 3 --callers persistent \
    2>&1 | tee "$OUT/gpu_staging_4x.log"

timeout 80 torchrun --standalone --nproc_per_node="$GPUS" bench/memory.py --device cuda \
    --size-mib "$SIZE" 2>&1 | tee "$OUT/memory_cuda.log"
