#!/usr/bin/env bash
# Run each collected test in its own process (a failed CUDA kernel poisons the process it ran in,
# so one fault otherwise fails every later GPU test), JOBS at a time, with CUDA_LAUNCH_BLOCKING=1.
#
#     bash benchmarks/run_isolated.sh OUTFILE tests/test_gpu.py tests/test_triton_kernels.py
#
# OUTFILE gets one line per test: "PASS|FAIL|SKIP <test id> <first error line>".
set -uo pipefail
out=$1; shift
PY=${PYTHON:-python3}
ids=$("$PY" -m pytest --collect-only -q -p no:cacheprovider "$@" | grep '::')
one() {
  local log; log=$(mktemp)
  CUDA_LAUNCH_BLOCKING=1 timeout 180 "$PY" -m pytest -q -rs -p no:cacheprovider "$1" > "$log" 2>&1
  local rc=$? status=PASS why=""
  if grep -q "1 skipped" "$log"; then status=SKIP; why=$(grep -m1 "^SKIPPED" "$log")
  elif [ $rc -ne 0 ]; then status=FAIL; why=$(grep -m1 -E "^E  " "$log" | cut -c1-300); fi
  echo "$status $1 $why"
  rm -f "$log"
}
export -f one; export PY
printf '%s\n' "$ids" | xargs -P "${JOBS:-8}" -I{} bash -c 'one "$@"' _ {} | sort > "$out"
echo "isolated: $(grep -c ^PASS "$out") passed, $(grep -c ^FAIL "$out") failed, $(grep -c ^SKIP "$out") skipped of $(wc -l < "$out")"
