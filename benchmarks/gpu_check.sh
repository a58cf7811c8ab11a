#!/usr/bin/env bash
# One device call (under 10 minutes on an H100) that checks the 2026-11-23 session's unmeasured work:
# GPU tests, GPT-2 with and without CUDA graphs (precompile and the far-fusion rule in effect), the
# GPT-2 budget rows beside inductor, and the built-in GPT's peak sweep. Logs and JSON land in $OUT;
# record the bench JSON with `python -m kiln.bench --from-json`.
#   with the device tool:  bash benchmarks/gpu_check.sh
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
step() {   # step NAME SECONDS command...: run with a time limit, log to $OUT/NAME.log
  local name=$1 limit=$2; shift 2
  echo "== $name (limit ${limit}s)"
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "   exit $?"
}
step gpu_tests 100 python3 -m pytest -p no:logging -m gpu tests/ -q
tail -4 "$OUT/gpu_tests.log"
KILN_DEBUG=1 step gpt2 200 python3 -m kiln.bench --suite models --cases gpt2 --backends inductor,kiln,kiln-cg \
  --device cuda --no-warm --no-record --json "$OUT/gpt2.json"
grep -h "precompile:\|^| gpt2" "$OUT/gpt2.log" | head -12
step gpt2_budget 170 python3 -m kiln.bench --suite models --cases gpt2 --backends inductor,kiln --budget 0.5,0.1 \
  --device cuda --no-warm --no-record --json "$OUT/gpt2_budget.json"
grep -h "^| gpt2" "$OUT/gpt2_budget.log" | head -4
step peak_sweep 90 python3 -m kiln.bench.peak_sweep --device cuda --size gpu --budgets 1,0.5,0.1,0 \
  --json "$OUT/sweep.json" --png "$OUT/sweep.png"
tail -7 "$OUT/peak_sweep.log"
