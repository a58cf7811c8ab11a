#!/usr/bin/env bash
# One device call (about 8 minutes on an H100): the GPU tests, then the model rows (GPT-2, ResNet-50
# train / inference / frozen inference) and the fp32 micro rows, each beside inductor in one run.
# Logs and JSON land in $OUT; record the JSON with `python -m kiln_bench --from-json FILE --record`.
#   with the device tool:  bash benchmarks/gpu_check.sh
# The precompile probe, the budget sweep and the host profile have their own commands (notes/STATUS.md).
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 200 python3 -m pytest -p no:logging -p no:cacheprovider -m gpu tests/ -q -rf --tb=short \
   > "$OUT/gpu_tests.log" 2>&1; echo "tests exit $?"; tail -2 "$OUT/gpu_tests.log"
KILN_DEBUG=1 timeout 260 python3 -m kiln_bench --suite models --backends inductor,kiln --device cuda \
  --cases gpt2,resnet50_train,resnet50_infer,resnet50_infer_freezing --no-warm \
  --json "$OUT/models.json" > "$OUT/models.log" 2>&1; echo "models exit $?"
grep -h "^| \|bench:" "$OUT/models.log"
timeout 170 python3 -m kiln_bench --suite micro --backends inductor,kiln --device cuda --dtype fp32 \
  --no-warm --json "$OUT/micro.json" > "$OUT/micro.log" 2>&1; echo "micro exit $?"
grep -h "^| " "$OUT/micro.log"
