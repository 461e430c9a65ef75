#!/usr/bin/env bash
# Runs a benchmark in its --quick mode (CI): it must exit 0 and print a JSON object.
set -euo pipefail
out=$("$1" --quick)
echo "$out"
case "$out" in
  "{"*"}") ;;
  *) echo "run_quick: $1 did not print a JSON object" >&2; exit 1 ;;
esac
