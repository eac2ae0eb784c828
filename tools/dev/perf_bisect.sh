#!/usr/bin/env bash
# perf_bisect.sh - one call on the GPU machine (device tool): build several source snapshots of
# Kiln and measure each one's prefill of a 512-token prompt and a shortened offline throughput
# (300 x (512 + 256) by default) on one random Qwen2-7B made once, with the card's copy and
# bf16 matrix ceilings measured once; a table on stdout and JSON under $OUT (issue 24).
# Usage (from the repo root there): bash tools/dev/perf_bisect.sh DEPS_DIR PERF_DIR
#   DEPS_DIR/*.deb         the Debian -dev packages, as for gpu_run.sh (tools/dev/gpu_env.sh)
#   PERF_DIR/*.tar.gz      source snapshots made with `git archive --format=tar.gz` (the commit
#                          is read back from the archive's header)
#   PERF_DIR/builds.txt    optional, the rows in the order they are measured, one a line:
#                            LABEL TARBALL [ARCHS [VAR=VALUE,VAR=VALUE]]
#                          ARCHS is KILN_CUDA_ARCHS (default 90a; quote nothing: "80;90;90a");
#                          rows with the same TARBALL and ARCHS share one build, so an
#                          environment switch (e.g. KILN_CUDA_NO_GEMV=1) costs no rebuild.
#                          Without the file: every tarball, in name order, archs 90a.
# Environment: PB_REQUESTS (300) requests of the throughput run; PB_BUDGET_S (530) seconds from
# the start after which no measurement starts (a device call may run 600 s); PB_JOBS (nproc).
# Builds: Release, -DKILN_HTTP=OFF -DKILN_BUILD_TESTS=OFF -DKILN_BACKEND_ROCM=OFF, only the kiln
# command and the cuda and cpu plugins, all trees under one make jobserver (-j$PB_JOBS).
# $OUT gets perf_bisect.json (every run's bench JSON, the ceilings, the machine), perf_bisect.txt
# (the table) and perf_bisect_logs.tar.gz (configure/build logs, model and bench logs).
set -uo pipefail
t_start=$(date +%s)
deadline=$((t_start + ${PB_BUDGET_S:-530}))
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
OUT=${OUT:-/tmp/kiln-perf-out}
mkdir -p "$OUT"
[ $# -eq 2 ] || { echo "usage: $0 DEPS_DIR PERF_DIR" >&2; exit 2; }
[ -d "$2" ] || { echo "perf_bisect: PERF_DIR '$2' is not a folder" >&2; exit 2; }
perf=$(cd "$2" && pwd)
# shellcheck source=tools/dev/gpu_env.sh
. "$here/tools/dev/gpu_env.sh" "$1"
work=/tmp/pb
rm -rf "$work"
mkdir -p "$work/logs"
finish() {
  (cd "$work" && tar czf "$OUT/perf_bisect_logs.tar.gz" logs) 2>/dev/null
}
trap finish EXIT
elapsed() { echo "$(( $(date +%s) - t_start )) s"; }

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 | tee "$work/logs/gpu.txt"

echo "== the model (on the GPU, while the CPUs build)"
python3 "$here/bench/perf_bisect.py" --make-model --work /tmp/m7 >"$work/logs/model.log" 2>&1 &
model_pid=$!

# ---- the rows --------------------------------------------------------------------------------
list=$work/builds.txt
if [ -f "$perf/builds.txt" ]; then
  grep -v '^[[:space:]]*\(#\|$\)' "$perf/builds.txt" >"$list"
else
  for t in "$perf"/*.tar.gz; do [ -e "$t" ] && echo "$(basename "$t" .tar.gz) $(basename "$t")"; done >"$list"
fi
[ -s "$list" ] || { echo "perf_bisect: no rows (no builds.txt and no *.tar.gz in $perf)" >&2; exit 2; }

declare -A tree_of=()   # "TARBALL ARCHS" -> build folder
trees=()
rows_tsv=$work/rows.tsv
: >"$rows_tsv"
while read -r label tarball archs env rest; do
  archs=${archs:-90a}
  env=${env:--}
  if [ -n "${rest:-}" ]; then echo "perf_bisect: row '$label': unexpected '$rest'" >&2; exit 2; fi
  if [ ! -f "$perf/$tarball" ]; then echo "perf_bisect: row '$label': no $perf/$tarball" >&2; exit 2; fi
  key="$tarball $archs"
  if [ -z "${tree_of[$key]:-}" ]; then
    n=${#trees[@]}
    dir=$work/t$n
    mkdir -p "$dir"
    tar xzf "$perf/$tarball" -C "$dir" || { echo "perf_bisect: cannot unpack $tarball" >&2; exit 2; }
    commit=$(python3 -c 'import sys, tarfile; print(tarfile.open(sys.argv[1]).pax_headers.get("comment", "?"))' "$perf/$tarball")
    echo "$commit" >"$dir/.commit"
    echo "$archs" >"$dir/.archs"
    tree_of[$key]=$dir
    trees+=("$dir")
  fi
  dir=${tree_of[$key]}
  printf '%s\t%s\t%s\t%s\t%s\n' "$label" "$dir" "$(cat "$dir/.commit")" "$archs" "$env" >>"$rows_tsv"
done <"$list"
echo "== ${#trees[@]} builds for $(wc -l <"$rows_tsv") rows:"; cut -f1,3,4,5 "$rows_tsv"

# ---- configure (in parallel), then one jobserver for every build ------------------------------
echo "== configure ($(elapsed))"
pids=()
for dir in "${trees[@]}"; do
  n=$(basename "$dir")
  cmake -G "Unix Makefiles" -S "$dir" -B "$dir/build" -DCMAKE_BUILD_TYPE=Release \
    "${KILN_DEPS_CMAKE_ARGS[@]}" -DKILN_HTTP=OFF -DKILN_BUILD_TESTS=OFF -DKILN_BACKEND_ROCM=OFF \
    -DKILN_CUDA_ARCHS="$(cat "$dir/.archs")" >"$work/logs/configure_$n.log" 2>&1 &
  pids+=($!)
done
for i in "${!pids[@]}"; do
  wait "${pids[$i]}" || { echo "configure of ${trees[$i]} failed:"; tail -15 "$work/logs/configure_$(basename "${trees[$i]}").log"; }
done
{
  printf 'all:'
  for dir in "${trees[@]}"; do [ -f "$dir/build/Makefile" ] && printf ' %s' "$(basename "$dir")"; done
  printf '\n'
  for dir in "${trees[@]}"; do
    n=$(basename "$dir")
    [ -f "$dir/build/Makefile" ] || continue
    printf '%s:\n\t+$(MAKE) -C %s/build kiln_cli kiln-backend-cuda kiln-backend-cpu >%s/logs/build_%s.log 2>&1\n' \
      "$n" "$dir" "$work" "$n"
  done
} >"$work/builds.mk"
echo "== build ($(elapsed))"
timeout 420 make -k -j"${PB_JOBS:-$(nproc)}" -f "$work/builds.mk" all >"$work/logs/make.log" 2>&1
for dir in "${trees[@]}"; do
  n=$(basename "$dir")
  if [ -x "$dir/build/bin/kiln" ] && [ -f "$dir/build/lib/kiln/libkiln-backend-cuda.so" ]; then
    echo "built $n ($(cat "$dir/.commit" | cut -c1-9), archs $(cat "$dir/.archs"))"
  else
    echo "BUILD FAILED $n ($(cat "$dir/.commit" | cut -c1-9)):"
    grep -E "error|Error" "$work/logs/build_$n.log" 2>/dev/null | head -10
  fi
done
echo "== builds done ($(elapsed)); waiting for the model"
wait "$model_pid" || { echo "model build failed:"; tail -20 "$work/logs/model.log"; exit 1; }
tail -2 "$work/logs/model.log"

echo "== measure ($(elapsed))"
python3 "$here/bench/perf_bisect.py" --work /tmp/m7 --builds "$rows_tsv" \
  --requests "${PB_REQUESTS:-300}" --deadline "$deadline" --ref "${PB_REF:-0815eff}" \
  --out "$OUT/perf_bisect.json" 2>&1 | grep -v -i warn | tee "$work/logs/measure.log" | tail -40
python3 -c 'import json, sys; print(json.load(open(sys.argv[1])).get("table", ""))' \
  "$OUT/perf_bisect.json" >"$OUT/perf_bisect.txt" 2>/dev/null
echo "== done ($(elapsed))"
