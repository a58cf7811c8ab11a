#!/usr/bin/env bash
# GPT-2 medium on 2 GPUs (issue #22): DDP and FSDP2, each under eager, kiln and inductor, 20 steps, then the
# summary $OUT/dist_gpt2.md (one JSON and one log per combination in $OUT). Each run gets empty Inductor,
# Triton and kiln caches (shared by its ranks) and a time cap, so that the six end within BUDGET_S (470 s).
#   on the 2-GPU machine:  bash benchmarks/dist_gpt2.sh
#   CPU smoke test here:   PYTHON=.venv/bin/python STEPS=6 bash benchmarks/dist_gpt2.sh --device cpu --tiny
# Extra arguments go to every run (see python benchmarks/dist_gpt2.py --help).
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
PYTHON=${PYTHON:-python3}; NPROC=${NPROC:-2}; STEPS=${STEPS:-20}; CAP_S=${CAP_S:-150}
DEADLINE=$((SECONDS + ${BUDGET_S:-470}))

run() {   # mode backend [extra args]
    local mode=$1 backend=$2 cap=$CAP_S left=$((DEADLINE - SECONDS)) start=$SECONDS cache rc
    shift 2
    (( left < cap )) && cap=$left
    if (( cap < 30 )); then echo "$mode $backend: skipped, out of time"; return; fi
    cache=$(mktemp -d)
    TORCHINDUCTOR_CACHE_DIR=$cache/inductor TRITON_CACHE_DIR=$cache/triton KILN_KERNEL_DIR=$cache/kiln \
        timeout --kill-after=10 "$cap" "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node="$NPROC" \
        benchmarks/dist_gpt2.py --mode "$mode" --backend "$backend" --steps "$STEPS" \
        --out "$OUT/dist_${mode}_${backend}.json" "$@" > "$OUT/dist_${mode}_${backend}.log" 2>&1
    rc=$?
    echo "$mode $backend: exit $rc, $((SECONDS - start)) s"
    (( rc == 0 )) || tail -5 "$OUT/dist_${mode}_${backend}.log"
    rm -rf "$cache"
}

for backend in eager kiln inductor; do
    for mode in ddp fsdp2; do
        run "$mode" "$backend" "$@"
    done
done
"$PYTHON" benchmarks/dist_gpt2.py --summarize "$OUT"/dist_*.json --md "$OUT/dist_gpt2.md"
