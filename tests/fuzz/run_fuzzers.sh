#!/usr/bin/env bash
# run_fuzzers.sh - runs Kiln's libFuzzer targets (tests/fuzz/fuzz_*.c) for a while each, from
# their seed corpora, after replaying every kept crash input; any crash, leak, timeout, memory
# blow-up or sanitizer report fails the run.
#
# Usage: tests/fuzz/run_fuzzers.sh BUILD_DIR [SECONDS] [TARGET...]
#   BUILD_DIR  a build configured with -DCMAKE_C_COMPILER=clang -DKILN_FUZZ=ON, with the
#              fuzzers built (cmake --build BUILD_DIR --target fuzzers)
#   SECONDS    fuzzing time per target (default 20); 0 replays the seeds and regressions only
#   TARGET     api config guide json template tokenizer tool_parse weights (default: all eight)
# Environment: KILN_FUZZ_JOBS (targets run at once, default 1), KILN_FUZZ_RSS_MB (default
# 2048), KILN_FUZZ_TIMEOUT (seconds for one input, default 10).
#
# For each target it makes a scratch folder, copies tests/fuzz/corpus/<target>/ and
# tests/fuzz/regressions/<target>/ there and fuzzes in it: nothing is written into the source
# tree (new corpus entries and crash artifacts stay in the scratch folder, which is kept, and
# named, when the target fails). The last line is "fuzz: N passed, M failed"; the exit status
# is 1 when any target failed, 2 on a usage error.
set -uo pipefail

usage() {
  sed -n '2,/^set /p' "$0" | sed '$d; s/^# \{0,1\}//' >&2
  exit 2
}
[ $# -ge 1 ] || usage
build=$1
shift
seconds=20
if [ $# -ge 1 ] && [[ $1 =~ ^[0-9]+$ ]]; then
  seconds=$1
  shift
fi
all_targets=(api config guide json template tokenizer tool_parse weights)
if [ $# -ge 1 ]; then targets=("$@"); else targets=("${all_targets[@]}"); fi
for t in "${targets[@]}"; do
  [[ " ${all_targets[*]} " == *" $t "* ]] || { echo "run_fuzzers: unknown target '$t' (${all_targets[*]})" >&2; exit 2; }
done
[ -d "$build" ] || { echo "run_fuzzers: no build folder '$build'" >&2; exit 2; }
jobs_max=${KILN_FUZZ_JOBS:-1}
rss_mb=${KILN_FUZZ_RSS_MB:-2048}
timeout=${KILN_FUZZ_TIMEOUT:-10}
for v in "$jobs_max" "$rss_mb" "$timeout"; do
  [[ $v =~ ^[1-9][0-9]*$ ]] || { echo "run_fuzzers: KILN_FUZZ_JOBS, KILN_FUZZ_RSS_MB and KILN_FUZZ_TIMEOUT must be positive integers" >&2; exit 2; }
done

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
build=$(cd "$build" && pwd)
results=$(mktemp -d "${TMPDIR:-/tmp}/kiln-fuzz.XXXXXX")
trap 'rm -rf "$results"' EXIT

# Leaks are errors; UBSan stops at its first report (the fuzz build lets it recover otherwise).
# A caller's own options come after ours, so they win.
export ASAN_OPTIONS="detect_leaks=1:strict_string_checks=1:detect_stack_use_after_return=1${ASAN_OPTIONS:+:$ASAN_OPTIONS}"
export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1:report_error_type=1${UBSAN_OPTIONS:+:$UBSAN_OPTIONS}"

# What a sanitizer or libFuzzer prints when something went wrong, in case one reports without
# changing the exit status.
report_re='ERROR: (AddressSanitizer|LeakSanitizer|libFuzzer)|runtime error:|check failed:|SUMMARY: (Address|Leak|Undefined)'

# Runs one target; writes $results/<t>.result ("pass SUMMARY" or "fail REASON") and keeps its
# logs in its scratch folder.
run_target() {
  local t=$1 bin="$build/tests/fuzz_$1"
  local work
  work=$(mktemp -d "${TMPDIR:-/tmp}/kiln-fuzz-$t.XXXXXX")
  echo "$work" >"$results/$t.work"
  if [ ! -x "$bin" ]; then
    echo "fail $bin is missing: build it with cmake --build $build --target fuzzers" >"$results/$t.result"
    return
  fi
  mkdir -p "$work/corpus" "$work/regressions"
  [ -d "$here/corpus/$t" ] && cp -R "$here/corpus/$t/." "$work/corpus/"
  local regs=()
  if [ -d "$here/regressions/$t" ]; then
    cp -R "$here/regressions/$t/." "$work/regressions/"
    local f
    for f in "$work/regressions"/*; do [ -f "$f" ] && regs+=("$f"); done
  fi
  local flags=(-timeout="$timeout" -rss_limit_mb="$rss_mb" -artifact_prefix="$work/"
               -print_final_stats=1)
  [ -f "$here/dict/$t.dict" ] && flags+=(-dict="$here/dict/$t.dict")
  local rc
  # 1. every kept crash input, one by one, so a failing one is named
  if [ ${#regs[@]} -gt 0 ]; then
    (cd "$work" && "$bin" "${flags[@]}" "${regs[@]}") >"$work/regressions.log" 2>&1
    rc=$?
    if [ $rc -ne 0 ] || grep -Eq "$report_re" "$work/regressions.log"; then
      echo "fail a regression input fails (exit $rc); log: $work/regressions.log" >"$results/$t.result"
      return
    fi
  fi
  # 2. fuzz from the seeds and the regression inputs (new inputs go to the first folder only)
  local mode=(-max_total_time="$seconds")
  [ "$seconds" = 0 ] && mode=(-runs=0)
  (cd "$work" && "$bin" "${flags[@]}" "${mode[@]}" corpus regressions) >"$work/fuzz.log" 2>&1
  rc=$?
  if [ $rc -ne 0 ] || grep -Eq "$report_re" "$work/fuzz.log"; then
    echo "fail exit $rc; log: $work/fuzz.log" >"$results/$t.result"
    return
  fi
  local runs cov
  runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$work/fuzz.log" | tail -1)
  cov=$(grep -Eo 'cov: [0-9]+ ft: [0-9]+ corp: [0-9]+' "$work/fuzz.log" | tail -1)
  echo "pass ${runs:-?} runs, ${cov:-no coverage line}; ${#regs[@]} regression inputs" >"$results/$t.result"
  rm -rf "$work"
}

echo "fuzz: ${targets[*]}: ${seconds} s each, $jobs_max at a time, in $build"
for t in "${targets[@]}"; do
  while [ "$(jobs -rp | wc -l)" -ge "$jobs_max" ]; do wait -n; done
  run_target "$t" &
done
wait

passed=0
failed=0
for t in "${targets[@]}"; do
  result=$(cat "$results/$t.result" 2>/dev/null || echo "fail the runner did not finish")
  if [ "${result%% *}" = pass ]; then
    passed=$((passed + 1))
    echo "fuzz: PASS fuzz_$t: ${result#pass }"
    continue
  fi
  failed=$((failed + 1))
  echo "fuzz: FAIL fuzz_$t: ${result#fail }"
  work=$(cat "$results/$t.work" 2>/dev/null || true)
  for log in "$work/regressions.log" "$work/fuzz.log"; do
    [ -f "$log" ] || continue
    echo "---- fuzz_$t: $(basename "$log"), the report:"
    # from the first error line on (bounded), else the tail
    start=$(grep -Enm1 "$report_re|ALARM: working on the last Unit|out-of-memory|deadly signal" "$log" | cut -d: -f1)
    if [ -n "$start" ]; then
      tail -n +"$((start > 5 ? start - 5 : 1))" "$log" | head -n 120
    else
      tail -n 60 "$log"
    fi
  done
  shopt -s nullglob
  for a in "$work"/crash-* "$work"/leak-* "$work"/timeout-* "$work"/oom-* "$work"/slow-unit-*; do
    echo "---- fuzz_$t: input $a ($(wc -c <"$a") bytes), first bytes:"
    od -A d -c "$a" | head -n 8
    echo "     keep it as a regression case: cp $a $here/regressions/$t/"
  done
  shopt -u nullglob
done
echo "fuzz: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
