#!/usr/bin/env bash
# launch_check under a real `srun -n 2` of the one-node Slurm cluster that
# tests/launch/slurm_cluster.sh starts (tools/setup.sh does): MASTER_ADDR and MASTER_PORT come
# from the node list and the job id. Then with CUDA_VISIBLE_DEVICES naming one device (device
# ordinal 0 on every rank), and inside an sbatch script without srun, which must be refused.
set -uo pipefail
bin=$(realpath "$1")
source "$(dirname "$0")/check.sh"
export SLURM_CONF=${ZERORT_SLURM_CONF:-${ZERORT_SLURM_DIR:-/tmp/zerort-slurm}/slurm.conf}
if ! command -v srun >/dev/null; then
  echo "FAIL: srun not installed: run tools/setup.sh (Debian's slurm-wlm)"; exit 1
fi
if ! timeout 20 sinfo -h -o %t 2>/dev/null | grep -qE '^(idle|mix|alloc)'; then
  echo "FAIL: no Slurm cluster answers at $SLURM_CONF: run tests/launch/slurm_cluster.sh" \
       "(tools/setup.sh does)"; exit 1
fi
tmp=${TEST_TMPDIR:-$(mktemp -d)}
cd "$tmp" || exit 1
status=0
run() {
  local label=$1 device=$2 out=$tmp/$1.out err=$tmp/$1.err
  shift 2
  echo "== $* srun -n 2"
  if ! env "$@" timeout 240 srun -n 2 -t 4 --kill-on-bad-exit=1 "$bin" --timeout_ms=60000 \
       >"$out" 2>"$err"; then
    echo "FAIL: srun ($label) exited non-zero"; cat "$out" "$err"; status=1; return
  fi
  check_ranks "$out" 2 slurm 0 "$device" || { cat "$err"; status=1; }
}
run plain "" -u CUDA_VISIBLE_DEVICES
run one_gpu 0 CUDA_VISIBLE_DEVICES=3
echo "== sbatch -n 2 without srun"
out=$tmp/batch.out
timeout 240 sbatch --wait -n 2 -t 4 -o "$out" --wrap "$bin --timeout_ms=60000" >/dev/null 2>&1
if grep -q "launch the program with srun" "$out" && ! grep -q '^launch_check ' "$out"; then
  echo "ok: refused: $(cat "$out")"
else
  echo "FAIL: the batch script was not refused:"; cat "$out"; status=1
fi
exit $status
