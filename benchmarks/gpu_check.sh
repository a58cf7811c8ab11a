#!/usr/bin/env bash
# One device call (about 5 minutes on an H100): the GPU tests (in the background), the precompile
# probe (do kiln's first launches load what the workers compiled?), the built-in GPT's peak sweep with
# the blocks alive at each peak, and GPT-2 beside inductor. Logs and JSON land in $OUT; record the
# bench JSON with `python -m kiln.bench --from-json`.
#   with the device tool:  bash benchmarks/gpu_check.sh
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
(timeout 200 python3 -m pytest -p no:logging -p no:cacheprovider -m gpu tests/ -q -rf --tb=short \
   > "$OUT/gpu_tests.log" 2>&1; echo "tests exit $?" >> "$OUT/gpu_tests.log") &
timeout 120 python3 benchmarks/precompile_probe.py --inductor-first > "$OUT/probe.log" 2>&1; echo "probe exit $?"
grep -v Warn "$OUT/probe.log" | head -6
timeout 200 python3 -m kiln.bench.peak_sweep --device cuda --size gpu --budgets 1,0.5,0.1,0 --explain-peak \
  --json "$OUT/sweep.json" --png "$OUT/sweep.png" > "$OUT/sweep.log" 2>&1; echo "sweep exit $?"
head -7 "$OUT/sweep.log"
wait
tail -6 "$OUT/gpu_tests.log"
KILN_DEBUG=1 timeout 200 python3 -m kiln.bench --suite models --cases gpt2 --backends inductor,kiln,kiln-cg \
  --device cuda --no-warm --no-record --json "$OUT/gpt2.json" > "$OUT/gpt2.log" 2>&1; echo "gpt2 exit $?"
grep -h "bench:\|^| gpt2" "$OUT/gpt2.log"
