#!/bin/bash
# zoo_rounds.sh on every GPU of the machine at once: case k goes to GPU k mod N, each stream on its own
# contiguous share of the host cores (cores.py then pins to the fast ones within that share), so the
# interleaved ratios of a case are measured within one process as before, N cases at a time:
#   bash benchmarks/zoo_gpus.sh LIMIT_S CASE...      results: $OUT/zoo.tgz (zoo_<case>.{json,md,log}, stream_K.log:
# one archive, since the device tool returns a bounded number of files)
set -u
LIMIT=$1; shift
export OUT=${OUT:-/tmp/kiln_zoo}; mkdir -p "$OUT"   # the streams' logs are opened here, before zoo_rounds.sh runs
N=$(nvidia-smi -L | wc -l); CORES=$(nproc); PER=$((CORES / N))
cases=("$@")
for k in $(seq 0 $((N - 1))); do
  mine=()
  for i in "${!cases[@]}"; do [ $((i % N)) -eq "$k" ] && mine+=("${cases[$i]}"); done
  [ ${#mine[@]} -eq 0 ] && continue
  CUDA_VISIBLE_DEVICES=$k taskset -c $((k * PER))-$(((k + 1) * PER - 1)) \
    bash benchmarks/zoo_rounds.sh "$LIMIT" "${mine[@]}" > "$OUT/stream_$k.log" 2>&1 &
done
wait
cd "$OUT" && cat stream_*.log && tar czf /tmp/zoo.tgz stream_*.log zoo_* && rm -f stream_*.log zoo_* &&
  mv /tmp/zoo.tgz .
