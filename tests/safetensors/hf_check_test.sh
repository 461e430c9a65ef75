#!/usr/bin/env bash
# hf_check.py with the `safetensors` and `numpy` packages of the virtual environment that
# tests/launch/torch_venv.sh makes. Skips, saying why, when that venv lacks them for want of
# network (as tests/launch/torchrun_test.sh does); fails when the venv exists but is incomplete.
set -uo pipefail
tool=$(realpath "$1")
script=$(realpath "$2")
home=$(getent passwd "$(id -u)" | cut -d: -f6)
venv=${ZERORT_TORCH_VENV:-$home/.cache/zerort/venv-torch}
if ! "$venv/bin/python" -c 'import numpy, safetensors' 2>/dev/null; then
  if [ ! -x "$venv/bin/python" ] && [ -f "$venv.failed" ] && grep -q '^no network' "$venv.failed"; then
    echo "SKIPPED: safetensors check: $(cat "$venv.failed")"
    exit 0
  fi
  if [ ! -x "$venv/bin/python" ]; then
    echo "SKIPPED: safetensors check: no venv at $venv (run tests/launch/torch_venv.sh)"
    exit 0
  fi
  echo "FAIL: $venv has no numpy/safetensors: run tests/launch/torch_venv.sh"
  exit 1
fi
tmp=${TEST_TMPDIR:-$(mktemp -d)}
exec "$venv/bin/python" "$script" "$tool" "$tmp"
