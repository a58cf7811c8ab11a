#!/bin/bash
# The GPU tests in N parallel shards on one GPU (compiles are host-bound; the device is shared):
#   bash benchmarks/gpu_tests.sh [N] [LIMIT_S]     results: $OUT/gpu_shard_K.log
set -u
N=${1:-3}; LIMIT=${2:-420}; OUT=${OUT:-/tmp/kiln_gpu}; mkdir -p "$OUT"
export PYTHONPATH=. KILN_ON_ERROR=raise
IDS=$(mktemp -d)   # the id lists stay out of $OUT: the device tool returns a limited number of files
python3 -m pytest -q -m gpu --collect-only -p no:cacheprovider tests 2>/dev/null | grep '::' > "$IDS/all.txt"
echo "collected $(wc -l < "$IDS/all.txt") gpu tests"
for k in $(seq 0 $((N - 1))); do
  awk -v n="$N" -v k="$k" 'NR % n == k' "$IDS/all.txt" > "$IDS/$k.txt"
  mapfile -t ids < "$IDS/$k.txt"
  timeout "$LIMIT" python3 -m pytest -q -m gpu -rfE --tb=short -p no:cacheprovider \
    "${ids[@]}" > "$OUT/gpu_shard_$k.log" 2>&1 &
done
wait
for k in $(seq 0 $((N - 1))); do echo "== shard $k"; tail -n 15 "$OUT/gpu_shard_$k.log"; done
