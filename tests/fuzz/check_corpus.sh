#!/usr/bin/env bash
# check_corpus.sh - the committed seed corpora (tests/fuzz/corpus/) are exactly what
# tests/fuzz/make_seeds.py writes: no hand-edited, stray or missing seed (ctest test_fuzz_corpus).
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 "$here/make_seeds.py" "$tmp" >/dev/null
if ! diff -r "$tmp" "$here/corpus"; then
  echo "check_corpus: tests/fuzz/corpus/ is not what make_seeds.py writes (left: the script's" \
       "output); run tests/fuzz/make_seeds.py and commit the result" >&2
  exit 1
fi
echo "check_corpus: $(find "$here/corpus" -type f | wc -l) seeds match make_seeds.py"
