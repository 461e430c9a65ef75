#!/usr/bin/env bash
# launch_check under a real `torchrun --no-python --nproc-per-node 2`, torch from PyPI in the
# virtual environment tests/launch/torch_venv.sh made (tools/setup.sh runs it): torchrun's
# MASTER_PORT is its own TCPStore, so the rendezvous must go through that store. Twice: the
# static rendezvous on a given port, and --standalone (c10d rendezvous on a free port). Then once
# with ZERORT_RENDEZVOUS_PORT, which bypasses the store (rank 0 binds that port).
# Skips, saying why, only when the venv could not be made for want of network.
set -uo pipefail
bin=$(realpath "$1")
source "$(dirname "$0")/check.sh"
home=$(getent passwd "$(id -u)" | cut -d: -f6)
venv=${ZERORT_TORCH_VENV:-$home/.cache/zerort/venv-torch}
if [ ! -x "$venv/bin/torchrun" ]; then
  if [ -f "$venv.failed" ] && grep -q '^no network' "$venv.failed"; then
    echo "SKIPPED: torchrun test: $(cat "$venv.failed")"
    exit 0
  fi
  echo "FAIL: no torchrun in $venv${venv:+ ($(cat "$venv.failed" 2>/dev/null))}:" \
       "run tests/launch/torch_venv.sh (tools/setup.sh does)"
  exit 1
fi
export HOME=${TEST_TMPDIR:-$(mktemp -d)} TMPDIR=${TEST_TMPDIR:-/tmp}
free_port() {
  "$venv/bin/python" -c \
    'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}
status=0
# run LABEL STORE [VAR=VALUE...] -- TORCHRUN_ARGS...
run() {
  local label=$1 store=$2 out=$TMPDIR/$1.out err=$TMPDIR/$1.err vars=()
  shift 2
  while [ "$1" != -- ]; do vars+=("$1"); shift; done
  shift
  echo "== ${vars[*]} torchrun $*"
  if ! env "${vars[@]}" timeout 240 "$venv/bin/torchrun" "$@" --no-python --nproc-per-node 2 \
       "$bin" --timeout_ms=60000 >"$out" 2>"$err"; then
    echo "FAIL: torchrun ($label) exited non-zero"; cat "$out"; tail -30 "$err"; status=1; return
  fi
  check_ranks "$out" 2 torchrun "$store" || { tail -30 "$err"; status=1; }
}
run static 1 -- --master-addr 127.0.0.1 --master-port "$(free_port)"
run standalone 1 -- --standalone
run override 0 ZERORT_RENDEZVOUS_PORT="$(free_port)" -- --standalone
exit $status
