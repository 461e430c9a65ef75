#!/usr/bin/env bash
# Checks an installed tree (tools/install.sh PREFIX) on a GPU machine it was copied to, where no
# compiler, Bazel or Debian package is guaranteed: not run by CI (tools/test.sh). Everything
# runs from an empty environment (env -i), as a trainer launched without LD_LIBRARY_PATH would:
#   - every library of lib/libzerort.so.0 and bin/zerort resolves (ldd), and where from;
#   - bin/zerort plan runs;
#   - bin/zerort_c_smoke (tests/consumers/gpu_trainer.c, built at install time): a few ZeRO
#     stage-2 steps on the CUDA device over NCCL at world 1, its fp32 masters against a CPU
#     run's. NCCL is found as libzerort finds it (docs/embedding.md): set ZERORT_NCCL_DIR to
#     point at one (it is passed through).
# Prints one "PASSED name", "SKIPPED name: why" or "FAILED name" line per check; exits 1 if any
# failed.
#
# Usage: tests/consumers/gpu_smoke.sh PREFIX
set -uo pipefail
if [ $# -ne 1 ]; then
  echo "usage: $0 PREFIX" >&2
  exit 2
fi
prefix=$(cd "$1" && pwd)
failed=0
result() {  # result <name> <status>
  if [ "$2" -eq 0 ]; then echo "PASSED $1"; else echo "FAILED $1"; failed=1; fi
}
clean_env=(env -i PATH=/usr/bin:/bin)
[ -n "${ZERORT_NCCL_DIR:-}" ] && clean_env+=("ZERORT_NCCL_DIR=$ZERORT_NCCL_DIR")
chmod u+x "$prefix"/bin/* 2>/dev/null

echo "machine: $(uname -m), $(ldd --version 2>&1 | head -1)"
command -v nvidia-smi >/dev/null && nvidia-smi -L
for f in "$prefix/lib/libzerort.so.0" "$prefix/lib/libzerort_mpi.so.0" "$prefix/bin/zerort" \
  "$prefix/bin/zerort_c_smoke"; do
  [ -e "$f" ] || continue
  echo "== ldd $(basename "$f") (empty environment), outside PREFIX/lib:"
  "${clean_env[@]}" ldd "$f" | grep -v "$prefix" | grep '=>'
  missing=$("${clean_env[@]}" ldd "$f" | grep -c 'not found')
  if [ "$(basename "$f")" = libzerort_mpi.so.0 ] && [ "$missing" -gt 0 ]; then
    echo "SKIPPED ldd-$(basename "$f"): OpenMPI not installed here (only zr_mpi_* needs it)"
    continue
  fi
  [ "$missing" -eq 0 ]
  result "ldd-$(basename "$f")" $?
done

if [ -x "$prefix/bin/zerort" ]; then
  "${clean_env[@]}" "$prefix/bin/zerort" plan --model gpt2-124m --world 8 --stage 2 | head -3
  result "zerort-plan" "${PIPESTATUS[0]}"
else
  # A copy trimmed to fit a transfer limit may leave the 10 MB command out.
  echo "SKIPPED zerort-plan: no $prefix/bin/zerort in this copy"
fi

if [ -x "$prefix/bin/zerort_c_smoke" ]; then
  "${clean_env[@]}" timeout 300 "$prefix/bin/zerort_c_smoke"
  st=$?
  if [ $st -eq 77 ]; then
    echo "SKIPPED zerort_c_smoke: no usable GPU (see above)"
  else
    result "zerort_c_smoke" $st
  fi
else
  echo "SKIPPED zerort_c_smoke: not in $prefix/bin (install.sh found no C compiler)"
fi
exit $failed
