#!/bin/bash
# The GPU tests in N parallel shards on one GPU (compiles are host-bound; the device is shared):
#   bash benchmarks/gpu_tests.sh [N] [LIMIT_S]     results: $OUT/gpu_shard_K.{log,xml}
set -u
N=${1:-3}; LIMIT=${2:-420}; OUT=${OUT:-/tmp/kiln_gpu}; mkdir -p "$OUT"
export PYTHONPATH=. KILN_ON_ERROR=raise
python3 -m pytest -q -m gpu --collect-only -p no:cacheprovider tests 2>/dev/null | grep '::' > "$OUT/gpu_ids.txt"
echo "collected $(wc -l < "$OUT/gpu_ids.txt") gpu tests"
for k in $(seq 0 $((N - 1))); do
  awk -v n="$N" -v k="$k" 'NR % n == k' "$OUT/gpu_ids.txt" > "$OUT/gpu_shard_$k.txt"
  mapfile -t ids < "$OUT/gpu_shard_$k.txt"
  timeout "$LIMIT" python3 -m pytest -q -m gpu -rfE --tb=short -p no:cacheprovider --junitxml="$OUT/gpu_shard_$k.xml" \
    "${ids[@]}" > "$OUT/gpu_shard_$k.log" 2>&1 &
done
wait
for k in $(seq 0 $((N - 1))); do echo "== shard $k"; tail -n 15 "$OUT/gpu_shard_$k.log"; done
