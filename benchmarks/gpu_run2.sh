#!/usr/bin/env bash
# Device call 2 of 2026-11-23 (session 4): GPU tests (in the background), the precompile probe, then
# kiln's GPT-2 budget rows. Logs in $OUT.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
(timeout 330 python3 -m pytest -p no:logging -p no:cacheprovider -m gpu tests/ -q -rf --tb=short --durations=15 \
   > "$OUT/gpu_tests.log" 2>&1; echo "tests exit $?" >> "$OUT/gpu_tests.log") &
timeout 200 python3 benchmarks/precompile_probe.py > "$OUT/probe.log" 2>&1; echo "probe exit $?"
cat "$OUT/probe.log" | grep -v Warning | head -60
wait
tail -40 "$OUT/gpu_tests.log"
KILN_DEBUG=1 timeout 220 python3 -m kiln.bench --suite models --cases gpt2 --backends kiln --budget 0.5,0.1 \
  --device cuda --no-warm --no-record --json "$OUT/gpt2_budget.json" > "$OUT/gpt2_budget.log" 2>&1; echo "budget exit $?"
grep -h "bench:\|^| gpt2" "$OUT/gpt2_budget.log"
