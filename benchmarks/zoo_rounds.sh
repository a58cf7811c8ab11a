#!/bin/bash
# Zoo cases one after another, each in its own process, its backends also timed in interleaved rounds
# (kiln bench --rounds 3; no profiled pass): bash benchmarks/zoo_rounds.sh LIMIT_S CASE...
# Results: $OUT/zoo_<case>.{json,md,log}; record each with --from-json FILE --record.
set -u
LIMIT=$1; shift
OUT=${OUT:-/tmp/kiln_zoo}; mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1
for c in "$@"; do
  timeout "$LIMIT" python3 -m kiln_bench --suite zoo --cases "$c" --device cuda --no-warm --no-kernels \
    --min-time 0.3 --rounds 3 --no-guard --json "$OUT/zoo_$c.json" --md "$OUT/zoo_$c.md" > "$OUT/zoo_$c.log" 2>&1
  echo "$c rc $?"
  grep -E "^\| $c |interleaved" "$OUT/zoo_$c.md" 2>/dev/null
done
