#!/usr/bin/env bash
# CI's dry run of the GPU bundle on a machine without a GPU (tools/test.sh runs it): builds the
# bundle (tools/gpu_bundle.sh) into a temporary folder, then checks what a lent GPU machine
# would meet, one "PASSED ..." or "FAILED ..." line per check:
#   - the bundle fits (48 MiB);
#   - every binary and library finds each library it needs in the bundle or among those every
#     machine has (glibc, libstdc++, libgcc_s), from an empty environment; only libnccl.so.2
#     (run.sh finds the machine's) may be missing, and none needs the driver (libcuda.so.1)
#     directly: the CUDA runtime loads it when a binary first calls CUDA;
#   - `env -i PATH=/usr/bin:/bin DIR/run.sh OUT --quick` exits 0, every binary started, every
#     test and benchmark of the bundle skipped for want of a GPU (or passed), OUT holds at most
#     three files, and run.sh found NCCL.
# Exits 1 if a check failed. Takes about a minute once the targets are built.
#
# Usage: tools/gpu_bundle/dry_run.sh [--keep DIR]   (--keep: build into DIR and leave it)
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
bundle=$tmp/bundle
if [ "${1:-}" = --keep ] && [ -n "${2:-}" ]; then bundle=$2; fi
failed=0
pass() { echo "PASSED $*"; }
fail() {
  echo "FAILED $*"
  failed=1
}
t0=$SECONDS

if ! tools/gpu_bundle.sh "$bundle" >"$tmp/build.log" 2>&1; then
  tail -30 "$tmp/build.log"
  fail "gpu_bundle: tools/gpu_bundle.sh $bundle"
  exit 1
fi
bytes=$(du -sb "$bundle" | cut -f1)
mib=$(awk -v b="$bytes" 'BEGIN { printf "%.1f", b / 1048576 }')
if [ "$bytes" -le $((48 << 20)) ]; then
  pass "gpu_bundle: built in $((SECONDS - t0))s, $mib MiB (limit 48 MiB)"
else
  fail "gpu_bundle: $mib MiB, over 48 MiB"
fi

# ------------------------------------------------------------ libraries
machine_lib='^(linux-vdso\.so\.1|/lib64/ld-linux-x86-64\.so\.2|ld-linux-x86-64\.so\.2|lib(c|m|pthread|dl|rt)\.so\.[0-9]+|libstdc\+\+\.so\.6|libgcc_s\.so\.1|libnccl\.so\.2)$'
# Problems of ELF file $1 (one per line): a library not found or found outside the bundle from an
# empty environment (so RUNPATH alone decides, as under run.sh), a direct need of the driver, a
# RUNPATH other than $2.
elf_problems() {
  local name arrow path dyn runpath
  while read -r name arrow path _; do
    if [ "$arrow" != "=>" ]; then continue; fi
    if [ "$path" = not ]; then
      [ "$name" = libnccl.so.2 ] || echo "$name not found"
    elif [[ $path != "$bundle"/* ]] && ! [[ $name =~ $machine_lib ]]; then
      echo "$name found outside the bundle, at $path"
    fi
  done < <(env -i PATH=/usr/bin:/bin ldd "$1" 2>&1)
  dyn=$(readelf -d "$1")
  if grep -q 'NEEDED.*\[libcuda\.so' <<<"$dyn"; then echo "needs libcuda.so.1 directly"; fi
  runpath=$(grep -E '\((RUNPATH|RPATH)\)' <<<"$dyn" | sed 's/.*\[\(.*\)\]/\1/')
  [ "$runpath" = "$2" ] || echo "RUNPATH '$runpath', not '$2'"
}
# One line per binary: ldd follows each library's own RUNPATH, so this covers the whole closure.
for f in "$bundle"/bin/*; do
  problems=$(elf_problems "$f" '$ORIGIN/../lib')
  if [ -z "$problems" ]; then
    nccl=""
    readelf -d "$f" | grep -q 'NEEDED.*\[libnccl\.so\.2\]' && nccl="; libnccl.so.2 from the machine"
    pass "gpu_bundle ldd ${f#"$bundle"/}: every library in the bundle or the C/C++ runtime, no libcuda.so.1 (cudart loads the driver)$nccl"
  else
    fail "gpu_bundle ldd ${f#"$bundle"/}: $(echo "$problems" | paste -sd';')"
  fi
done
# The libraries themselves, in one line.
problems=$(for f in "$bundle"/lib/*; do elf_problems "$f" '$ORIGIN' | sed "s|^|${f##*/}: |"; done)
if [ -z "$problems" ]; then
  pass "gpu_bundle ldd lib/: $(ls "$bundle/lib" | wc -l) libraries, each with RUNPATH \$ORIGIN and every dependency found"
else
  fail "gpu_bundle ldd lib/: $(echo "$problems" | paste -sd';')"
fi

# ------------------------------------------------------------ run.sh from an empty environment
out=$tmp/out
t1=$SECONDS
env -i PATH=/usr/bin:/bin "$bundle/run.sh" "$out" --quick >"$tmp/run.out" 2>&1
rc=$?
if [ $rc -eq 0 ]; then
  pass "gpu_bundle run.sh --quick: exit 0 in $((SECONDS - t1))s"
else
  cat "$tmp/run.out"
  fail "gpu_bundle run.sh --quick: exit $rc"
fi
files=$(ls -A "$out" | wc -l)
if [ "$files" -le 3 ]; then
  pass "gpu_bundle run.sh: $files files in OUT ($(ls "$out" | tr '\n' ' '))"
else
  fail "gpu_bundle run.sh: $files files in OUT, at most 3 come back"
fi
if grep -q '^nccl: /' "$out/run.log"; then
  pass "gpu_bundle run.sh: $(grep -m1 '^nccl: /' "$out/run.log" | cut -d' ' -f1-2)"
else
  fail "gpu_bundle run.sh: NCCL not found ($(grep -m1 '^nccl:' "$out/run.log"))"
fi
# Every test and benchmark started and skipped cleanly: a line each, none FAILED, none stopped
# by the time budget.
while read -r kind label _; do
  line=$(grep -m1 -E "^(PASSED|SKIPPED|FAILED) $label( |:)" "$out/summary.txt")
  case $line in
    '') fail "gpu_bundle run.sh $label: no line in summary.txt" ;;
    FAILED* | *"out of time"* | *"budget"*) fail "gpu_bundle run.sh $kind: $line" ;;
    *) pass "gpu_bundle run.sh $kind: $line" ;;
  esac
done < <(grep -E '^(test|bench|demo) ' "$bundle/manifest.txt")
while read -r line; do
  fail "gpu_bundle run.sh: $line"
done < <(grep "^FAILED" "$out/summary.txt" | grep -v "^FAILED //")
echo "gpu_bundle dry run: $((SECONDS - t0))s"
exit $failed
