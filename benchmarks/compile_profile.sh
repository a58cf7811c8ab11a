#!/usr/bin/env bash
# Where a first call's time goes, cold (empty caches) then warm (a new process on the caches the first left):
# cProfile of `kiln bench-compile`'s child for each case, KILN_DEBUG stage times, and the top functions.
#   [BACKEND=inductor] bash benchmarks/compile_profile.sh OUTDIR gpt2 [llama ...] [--device cuda]
# Run from the repository root (PYTHONPATH=. on the GPU machine). Build workers' time is not in the profile:
# the main process's waits for them are.
set -euo pipefail
out=$1; shift
device=cuda
cases=()
while [ $# -gt 0 ]; do
  case $1 in --device) device=$2; shift 2;; *) cases+=("$1"); shift;; esac
done
mkdir -p "$out"
py=${PYTHON:-python3}
for c in "${cases[@]}"; do
  root=$(mktemp -d /tmp/kiln-prof-XXXX)
  export KILN_CACHE_DIR=$root/kiln TRITON_CACHE_DIR=$root/triton KILN_KERNEL_DIR=$root/kernels KILN_CACHE=1 \
         TORCHINDUCTOR_CACHE_DIR=$root/inductor
  for phase in cold warm; do
    KILN_DEBUG=1 $py -m cProfile -o "$out/$c.$phase.prof" -m kiln_bench.compile_times --child "$c" "${BACKEND:-kiln}" "$device" \
      > "$out/$c.$phase.json" 2> "$out/$c.$phase.debug.txt" || echo "$c $phase failed: $(tail -1 "$out/$c.$phase.debug.txt")"
    echo "== $c $phase: $(tail -1 "$out/$c.$phase.json")"
    $py - "$out/$c.$phase.prof" <<'PY' > "$out/$c.$phase.top.txt"
import pstats, sys
s = pstats.Stats(sys.argv[1])
s.sort_stats("cumulative").print_stats(45)
s.sort_stats("tottime").print_stats(25)
PY
    grep -E "kiln\]|stage|s$" "$out/$c.$phase.debug.txt" | tail -40 > "$out/$c.$phase.stages.txt" || true
  done
  rm -rf "$root"
done
