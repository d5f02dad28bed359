#!/usr/bin/env bash
# The CPU benchmarks that need more cores than ranks (a spare core for the hashing
# thread, 4 ranks without oversubscription), for a machine that has them (the 2-core CI
# VM has not). Logs go to $OUT (default /tmp/many_core_check).
#
#     bash bench/many_core_check.sh [SECONDS]
#
# Each step has its own timeout; the whole stays within SECONDS (default 400), the most
# useful steps first. Uses the python3 on the PATH; the package from this checkout.
set -u
OUT=${OUT:-/tmp/many_core_check}
BUDGET=${1:-400}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD:$PWD/bench${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
END=$(($(date +%s) + BUDGET))

step() {  # step NAME MAX_SECONDS COMMAND...: run it with what is left of the budget
    local name=$1 max=$2 left
    shift 2
    left=$((END - $(date +%s)))
    ((left < max)) && max=$left
    if ((max < 10)); then
        echo "skipped $name: budget spent" | tee -a "$OUT/skipped.log"
        return
    fi
    echo "== $name (at most ${max}s)"
    timeout "$max" "$@" 2>&1 | tee "$OUT/$name.log"
}

nproc | tee "$OUT/machine.log"
lscpu | grep -E "Model name|^CPU\(s\)" | tee -a "$OUT/machine.log"

# Issue 9: what verification costs a hot load where a core is free for the hashing thread.
step checksum_td_big_1 60 torchrun --standalone --nproc_per_node=1 bench/checksum_overlap.py --layout torch_dist --repeat 6
step checksum_td_big_2 70 torchrun --standalone --nproc_per_node=2 bench/checksum_overlap.py --layout torch_dist --repeat 6
step checksum_rb_big_2 70 torchrun --standalone --nproc_per_node=2 bench/checksum_overlap.py --layout raw_bytes --repeat 6
# The 10,000-tensor case on one rank: batches of small items, checked inline.
step checksum_rb_mid_1 60 torchrun --standalone --nproc_per_node=1 bench/checksum_overlap.py --layout raw_bytes --case mid --repeat 6
# One 256 MiB tensor: torch_dist cuts the item's read into parts for its threads (the same
# with READ_SPAN_BYTES of 1 TiB: read in one go, as before), raw_bytes cuts its entry.
step checksum_td_one_1 40 torchrun --standalone --nproc_per_node=1 bench/checksum_overlap.py --layout torch_dist --case one --repeat 6
step checksum_td_one_1_uncut 40 env DIST_CKPT_READ_SPAN_BYTES=1099511627776 torchrun --standalone \
    --nproc_per_node=1 bench/checksum_overlap.py --layout torch_dist --case one --repeat 6
step checksum_rb_one_1 40 torchrun --standalone --nproc_per_node=1 bench/checksum_overlap.py --layout raw_bytes --case one --repeat 6
# Page-cache reads on more threads than files, with and without an inline CRC per piece.
step read_threads_1 60 python3 bench/read_threads.py --procs 1
step read_threads_2 80 python3 bench/read_threads.py --procs 2
# Reading threads (READ_THREADS; default: the rank's share of the cores, at most 8, and
# at most 4 for reads averaging under 1 MiB): the caps, checked on both kinds of load.
for threads in 2 4 8 12; do
    step "read_threads_rb_mid_1_$threads" 30 env DIST_CKPT_READ_THREADS=$threads torchrun \
        --standalone --nproc_per_node=1 bench/checksum_overlap.py --layout raw_bytes --case mid --repeat 4
    step "read_threads_big_2_$threads" 40 env DIST_CKPT_READ_THREADS=$threads torchrun \
        --standalone --nproc_per_node=2 bench/table_run.py --cases big --methods raw,raw_bytes,ours \
        --repeat 3 --no-plan --out "$OUT/read_threads_big_2_$threads.json"
done
# Write-back started while a file is written (WRITEBACK_BYTES) against none, same run.
for round in 1 2; do
    for wb in 0 16777216; do
        step "writeback_${wb}_$round" 60 env DIST_CKPT_WRITEBACK_BYTES=$wb torchrun \
            --standalone --nproc_per_node=1 bench/table_run.py --cases big,mid \
            --methods raw,raw_bytes,ours --repeat 3 --no-plan --out "$OUT/writeback_${wb}_$round.json"
    done
done
# Issue 11: microseconds per tensor on a current CPU core.
step raw_bytes_speed_1 60 torchrun --standalone --nproc_per_node=1 bench/raw_bytes_speed.py --cases small --repeat 5
# The table on 1, 2 and 4 ranks with a core per rank (the 100,000-tensor case left out).
step table 240 python3 bench/table.py --ranks 1,2,4 --cases big,mid --timeout 110 \
    --json "$OUT/table.json"
# Then, as far as the budget goes:
step checksum_td_mid_2 90 torchrun --standalone --nproc_per_node=2 bench/checksum_overlap.py --layout torch_dist --case mid --repeat 4
step raw_bytes_speed_4 90 torchrun --standalone --nproc_per_node=4 bench/raw_bytes_speed.py --cases small --repeat 3
