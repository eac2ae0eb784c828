#!/usr/bin/env bash
# test_python.sh - Kiln's Python package (python/) with the system python3 (Debian's
# /usr/bin/python3 when it is there; $KILN_PYTHON overrides):
#   1. its unittest suite (python/tests, against the kiln command) from the source tree, with
#      KILN_LIBRARY pointing at this build's libkiln.so;
#   2. `pip install ./python` into a fresh virtual environment with no network (--no-index):
#      the in-tree build backend must need nothing from PyPI, the installed package must load
#      this build's libkiln.so (recorded at install time from KILN_BUILD_DIR) with no
#      environment variable, and pass the same suite.
# Usage: test_python.sh BUILD_DIR SOURCE_DIR
set -euo pipefail
BUILD=$(cd "${1:?usage: test_python.sh BUILD_DIR SOURCE_DIR}" && pwd)
SRC=$(cd "${2:?source dir}" && pwd)
PY=${KILN_PYTHON:-}
if [ -z "$PY" ]; then
  if [ -x /usr/bin/python3 ]; then PY=/usr/bin/python3; else PY=$(command -v python3); fi
fi
TMP=$(mktemp -d /tmp/kiln-python-XXXXXX)
trap 'rm -rf "$TMP"' EXIT
fail() {
  echo "FAIL: $*" >&2
  exit 1
}
echo "python: $PY ($("$PY" --version 2>&1))"
export KILN_BIN="$BUILD/bin/kiln" KILN_SOURCE_DIR="$SRC"
unset KILN_LIBRARY KILN_BUILD_DIR KILN_CONFIG PYTHONPATH VIRTUAL_ENV

echo "---- 1. the suite from the source tree"
(cd "$TMP" && KILN_LIBRARY="$BUILD/lib/libkiln.so" PYTHONPATH="$SRC/python" \
  "$PY" -m unittest discover -s "$SRC/python/tests" -t "$SRC/python/tests" -v) ||
  fail "the suite failed from the source tree"

echo "---- 2. pip install ./python, offline, into a virtual environment"
"$PY" -m venv "$TMP/venv" >"$TMP/venv.log" 2>&1 || {
  cat "$TMP/venv.log" >&2
  fail "python3 -m venv failed (Debian: apt-get install python3-venv)"
}
(cd "$SRC" && KILN_BUILD_DIR="$BUILD" PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
  "$TMP/venv/bin/pip" install --no-index --no-cache-dir ./python) >"$TMP/pip.log" 2>&1 || {
  cat "$TMP/pip.log" >&2
  fail "pip install ./python failed"
}
tail -n 1 "$TMP/pip.log"
got=$(cd "$TMP" && "$TMP/venv/bin/python" -c 'import kiln; print(kiln.__file__); print(kiln.LIBRARY_PATH)')
echo "$got"
case "$got" in
"$TMP/venv/"*) ;;
*) fail "the venv's python imports kiln from elsewhere: $got" ;;
esac
[ "$(echo "$got" | tail -n 1)" = "$BUILD/lib/libkiln.so" ] ||
  fail "the installed package loads $(echo "$got" | tail -n 1), not $BUILD/lib/libkiln.so"
(cd "$TMP" && "$TMP/venv/bin/python" -m unittest discover -s "$SRC/python/tests" \
  -t "$SRC/python/tests") || fail "the suite failed with the installed package"
echo "test_python: all passed"
