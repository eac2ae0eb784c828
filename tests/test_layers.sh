#!/usr/bin/env bash
# test_layers.sh - no file includes a header of a layer above its own (tests/check_layers.py),
# and the check itself catches every kind of upward or foreign include on a made-up tree.
set -euo pipefail
SRC=${KILN_SOURCE_DIR:-$(cd "$(dirname "$0")/.." && pwd)}
CHECK="$SRC/tests/check_layers.py"
python3 "$CHECK" "$SRC"

T=$(mktemp -d); trap 'rm -rf "$T"' EXIT
mk() { mkdir -p "$T/$(dirname "$1")"; printf '%s\n' "${@:2}" > "$T/$1"; }
for h in base/status.h hal/loader.h hal/include/kiln/hal.h models/model.h core/kv/bm.h \
         server/api.h tools/cli.h include/kiln/kiln.h backends/cuda/cuda_internal.h \
         plugins/trace/trace.h plugins/other/other.h tests/helper.h; do mk "$h" ""; done
# Allowed: down or sideways, the ABI from a plugin, a plugin's own headers, rocm -> cuda.
mk models/ok.c '#include "base/status.h"' '#include "hal/loader.h"' '#include "kiln/hal.h"' \
   '#include "model.h"' '#include <stdio.h>'
mk tools/ok.c '#include "core/kv/bm.h"' '#include "server/api.h"' '#include "kiln/kiln.h"'
mk backends/rocm/ok.c '#include "cuda_internal.h"' '#include <kiln/hal.h>'
mk plugins/trace/ok.c '#include "trace.h"' '#include "kiln/hal.h"'
# Each of these lines is one violation.
mk base/bad.c '#include "hal/loader.h"'                 # base -> hal
mk hal/bad.c '#include "models/model.h"'                # hal -> models
mk models/bad.c '#include "core/kv/bm.h"' '#include "kiln/kiln.h"'   # models -> core (x2)
mk core/bad.c '#include "server/api.h"'                 # core -> server
mk server/bad.c '#include "tools/cli.h"'                # server -> tools
mk backends/cpu/bad.c '#include "base/status.h"'        # a plugin -> base
mk plugins/trace/bad.c '#include "../other/other.h"'    # a plugin -> another plugin
mk core/bad2.c '#include "tests/helper.h"' '#include "nowhere.h"'    # -> tests; unresolved
set +e
out=$(python3 "$CHECK" "$T"); rc=$?
set -e
echo "$out"
[ "$rc" = 1 ] || { echo "FAIL: check exited $rc on a tree with violations"; exit 1; }
n=$(grep -cE '^[^ ]+:[0-9]+: ' <<<"$out")
[ "$n" = 10 ] || { echo "FAIL: expected 10 violations, got $n"; exit 1; }
for f in base/bad.c hal/bad.c models/bad.c core/bad.c server/bad.c backends/cpu/bad.c \
         plugins/trace/bad.c core/bad2.c; do
  grep -q "^$f:" <<<"$out" || { echo "FAIL: $f not reported"; exit 1; }
done
if grep -q ':.*ok\.c' <<<"$out"; then echo "FAIL: an allowed include was reported"; exit 1; fi
echo "test_layers: ok"
