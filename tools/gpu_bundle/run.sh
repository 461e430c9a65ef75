#!/usr/bin/env bash
# Runs a GPU bundle (tools/gpu_bundle.sh) on the machine it is on: no Bazel, no network needed.
#
# Usage: DIR/run.sh OUT [--quick]
#   full:    the tests, the GPT demo on the GPU beside PyTorch's, cuda_bench at 1e8 and 1e9 elements, torch's fused AdamW on the same sizes
#            (with /opt/torch/.venv/bin/python or $ZERORT_TORCH_PYTHON), then compute-sanitizer
#            (memcheck, racecheck, synccheck) on the engine/kernel tests, then the host SIMD
#            kernels' tests and adamw_bench's compact forms on this machine's CPU (its AVX-512
#            path, which the build machines lack), while time is left: at most 6 minutes in all
#            ($ZERORT_BUNDLE_BUDGET_S).
#   --quick: the tests, small benchmarks and memcheck on the kernel tests, then the host SIMD
#            tests and adamw_bench --quick: at most 3 minutes.
# Each step runs under its own timeout, cut to the time left; a step that cannot start in time
# is SKIPPED. It writes three files into OUT, appending as it goes (a run cut short keeps what
# it did):
#   OUT/summary.txt       one line per step: "PASSED NAME (ran on GPU)", "SKIPPED NAME: reason" or
#                         "FAILED NAME: what", then a "TOTAL:" line
#   OUT/run.log           everything: the machine, NCCL's path, each step's command and output
#   OUT/benchmarks.json   the benchmarks' JSON documents, one after another (jq -s . reads them)
# Exits 1 if a step failed, or if a GPU test skipped although nvidia-smi lists a GPU.
#
# NCCL is not in the bundle (218 MB). It is taken, in this order, from $ZERORT_NCCL_DIR, a
# Python environment's nvidia-nccl wheel (/opt/torch/.venv first, then each python3's
# site-packages), or the system (ld.so's cache, /usr/local/cuda/lib64); LD_LIBRARY_PATH is set
# to a folder holding only that libnccl.so.2, so every other library comes from the bundle.
set -uo pipefail

if [ $# -lt 1 ] || [ $# -gt 2 ] || { [ $# -eq 2 ] && [ "$2" != --quick ]; }; then
  echo "usage: $0 OUT [--quick]" >&2
  exit 2
fi
quick=0
[ "${2:-}" = --quick ] && quick=1
bundle=$(cd "$(dirname "$0")" && pwd)
# A copy that lost the executable bits (run as `bash DIR/run.sh`) still runs.
chmod u+x "$bundle"/bin/* 2>/dev/null
mkdir -p "$1" || exit 2
out=$(cd "$1" && pwd)
summary=$out/summary.txt
log=$out/run.log
json=$out/benchmarks.json
: >"$summary"
: >"$log"
: >"$json"
start=$SECONDS
if [ $quick -eq 1 ]; then budget=${ZERORT_BUNDLE_BUDGET_S:-180}; else budget=${ZERORT_BUNDLE_BUDGET_S:-360}; fi
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
passed=0 skipped=0 failed=0

logline() { echo "$*" >>"$log"; }
result() {  # result PASSED|SKIPPED|FAILED "name..." : one summary line, echoed to stdout
  echo "$*" >>"$summary"
  echo "$*"
  logline "== $*"
  case $1 in
    PASSED) passed=$((passed + 1)) ;;
    SKIPPED) skipped=$((skipped + 1)) ;;
    *) failed=$((failed + 1)) ;;
  esac
}
left() { echo $((budget - (SECONDS - start))); }
oneline() { tr -s ' \n\t' ' ' | sed 's/^ //; s/ $//' | cut -c1-300; }

# ---------------------------------------------------------------- the machine
logline "gpu bundle run: $(date -u +%Y-%m-%dT%H:%M:%SZ), quick=$quick, budget ${budget}s"
cat "$bundle/bundle.txt" >>"$log" 2>/dev/null
logline "host: $(uname -a)"
logline "glibc: $(ldd --version 2>&1 | head -1)"
# The host kernels' best SIMD level here (offload/simd.h picks it the same way, from CPUID).
simd=scalar
grep -qw avx2 /proc/cpuinfo 2>/dev/null && simd=avx2
grep -qw avx512f /proc/cpuinfo 2>/dev/null && simd=avx512
logline "cpu: $(grep -m1 'model name' /proc/cpuinfo 2>/dev/null | sed 's/.*: //'), $(nproc) cores, \
SIMD up to $simd ($(grep -m1 -ow -E 'avx512_bf16|avx512bw' /proc/cpuinfo 2>/dev/null | sort -u | oneline))"
gpu_seen=0
smi=$(command -v nvidia-smi || true)
if [ -n "$smi" ] && "$smi" -L >"$scratch/smi" 2>&1 && grep -q '^GPU ' "$scratch/smi"; then
  gpu_seen=1
  "$smi" >>"$log" 2>&1
else
  logline "nvidia-smi: ${smi:-not found}: $(cat "$scratch/smi" 2>/dev/null | oneline)"
fi

find_nccl() {
  local f py sp
  if [ -n "${ZERORT_NCCL_DIR:-}" ]; then
    if [ -e "$ZERORT_NCCL_DIR/libnccl.so.2" ]; then
      echo "$ZERORT_NCCL_DIR/libnccl.so.2"
      return
    fi
    logline "ZERORT_NCCL_DIR=$ZERORT_NCCL_DIR holds no libnccl.so.2; looking elsewhere"
  fi
  for f in /opt/torch/.venv/lib/python3*/site-packages/nvidia/nccl/lib/libnccl.so.2; do
    [ -e "$f" ] && { echo "$f"; return; }
  done
  for py in python3 /usr/bin/python3 /usr/local/bin/python3 /opt/*/.venv/bin/python3 \
    /opt/conda/bin/python3; do
    command -v "$py" >/dev/null 2>&1 || continue
    while read -r sp; do
      [ -e "$sp/nvidia/nccl/lib/libnccl.so.2" ] && { echo "$sp/nvidia/nccl/lib/libnccl.so.2"; return; }
    done < <("$py" -c 'import site; print("\n".join(site.getsitepackages() + [site.getusersitepackages()]))' 2>/dev/null)
  done
  for f in $( (/sbin/ldconfig -p || ldconfig -p) 2>/dev/null | awk '$1 == "libnccl.so.2" {print $NF}') \
    /usr/local/cuda/lib64/libnccl.so.2 /usr/lib/x86_64-linux-gnu/libnccl.so.2 \
    /usr/local/nccl/lib/libnccl.so.2; do
    [ -e "$f" ] && { echo "$f"; return; }
  done
}
nccl=$(find_nccl)
if [ -n "$nccl" ]; then
  mkdir "$scratch/nccl"
  ln -s "$nccl" "$scratch/nccl/libnccl.so.2"
  export LD_LIBRARY_PATH=$scratch/nccl
  logline "nccl: $nccl (LD_LIBRARY_PATH=$LD_LIBRARY_PATH holds only it)"
else
  unset LD_LIBRARY_PATH
  logline "nccl: not found (set ZERORT_NCCL_DIR to a folder with libnccl.so.2); binaries that need it will not start"
fi

sanitizer=""
for s in compute-sanitizer /usr/local/cuda/bin/compute-sanitizer \
  /usr/local/cuda/compute-sanitizer/compute-sanitizer /usr/local/cuda-*/bin/compute-sanitizer; do
  if command -v "$s" >/dev/null 2>&1; then sanitizer=$(command -v "$s"); break; fi
done
logline "compute-sanitizer: ${sanitizer:-not found}"

# ---------------------------------------------------------------- running one step
# run_step NAME TIMEOUT STDOUT_FILE CMD...: runs CMD (stderr, and stdout unless STDOUT_FILE is
# given, appended to the log as it goes) with TIMEOUT cut to the time left. Sets rc (124: timed
# out, 125: not started, under 15 s left), secs, cut (1 when the time left shortened TIMEOUT) and
# step_log (the step's part of the log).
run_step() {
  local name=$1 limit=$2 stdout=$3
  shift 3
  local remaining
  remaining=$(left)
  step_log=$scratch/step.log
  : >"$step_log"
  cut=0
  if [ "$remaining" -lt 15 ]; then
    rc=125 secs=0
    return
  fi
  if [ "$limit" -gt "$remaining" ]; then
    limit=$remaining
    cut=1
  fi
  logline ""
  logline "== $name: $* (timeout ${limit}s)"
  local offset t0=$SECONDS
  offset=$(stat -c %s "$log")
  mkdir -p "$scratch/tmp"
  # TEST_TMPDIR: Bazel's per-test scratch folder, which some tests read.
  if [ -n "$stdout" ]; then
    (cd "$scratch/tmp" && TEST_TMPDIR=$scratch/tmp timeout -k 10 "$limit" "$@") \
      >"$stdout" 2>>"$log"
  else
    (cd "$scratch/tmp" && TEST_TMPDIR=$scratch/tmp timeout -k 10 "$limit" "$@") >>"$log" 2>&1
  fi
  rc=$?
  secs=$((SECONDS - t0))
  tail -c +$((offset + 1)) "$log" >"$step_log"
  [ -n "$stdout" ] && cat "$stdout" >>"$log"
  logline "== $name: exit $rc after ${secs}s"
  rm -rf "$scratch/tmp"
}

# For a step that did not pass: SKIPPED when the budget, not the step, stopped it; else FAILED.
not_passed() {  # not_passed NAME
  if [ $rc -eq 125 ]; then
    result SKIPPED "$1: out of time (${budget}s budget)"
  elif [ $cut -eq 1 ] && { [ $rc -eq 124 ] || [ $rc -eq 137 ]; }; then
    result SKIPPED "$1: stopped after ${secs}s at the end of the ${budget}s budget (incomplete)"
  else
    result FAILED "$1: $(why_failed)"
  fi
}

# The reason a step did not pass, from its exit status and output.
why_failed() {
  case $rc in
    124 | 137) echo "timed out after ${secs}s" ;;
    127) echo "did not start: $(grep -m1 -E 'error while loading|not found' "$step_log" | oneline)" ;;
    *)
      local detail
      # Catch2's first failure: "file:line: FAILED:", the expression and its expansion.
      detail=$(grep -m1 -A4 -E 'FAILED|failed|ERROR|error|Error' "$step_log" | oneline)
      echo "exit $rc after ${secs}s${detail:+: $detail}"
      ;;
  esac
}

# ---------------------------------------------------------------- the steps
declare -a test_labels test_files kernel_tests bench_labels bench_files demo_files
declare -a host_test_labels host_test_files host_bench_labels host_bench_files
while read -r kind label rest; do
  file=${rest%% *} flags=${rest#"$file"} flags=${flags# }
  if [[ ",$flags," == *,host,* ]]; then  # the CPU's kernels: run last, after the GPU's work
    case $kind in
      test)
        host_test_labels+=("$label")
        host_test_files+=("$file")
        ;;
      bench)
        host_bench_labels+=("$label")
        host_bench_files+=("$file")
        ;;
    esac
    continue
  fi
  case $kind in
    test)
      test_labels+=("$label")
      test_files+=("$file")
      [[ ",$flags," == *,kernel,* ]] && kernel_tests+=("$label $file")
      ;;
    bench)
      bench_labels+=("$label")
      bench_files+=("$file")
      ;;
    demo) demo_files+=("$file") ;;
    excluded) result SKIPPED "$label: not in the bundle: $rest" ;;
  esac
done < <(grep -v '^#' "$bundle/manifest.txt")

runfiles_env() {  # the TEST_SRCDIR of a test with data files, or nothing
  local name=${1##*:}
  [ -d "$bundle/runfiles/$name" ] && echo "$bundle/runfiles/$name"
}

gpu_ran=0
run_test() {  # run_test LABEL FILE TIMEOUT
  local label=$1 file=$2 limit=$3 srcdir
  srcdir=$(runfiles_env "$label")
  if [ -n "$srcdir" ]; then
    run_step "$label" "$limit" "" env TEST_SRCDIR="$srcdir" RUNFILES_DIR="$srcdir" \
      TEST_WORKSPACE=zerort "$bundle/$file" --durations yes
  else
    run_step "$label" "$limit" "" "$bundle/$file" --durations yes
  fi
  if [ $rc -ne 0 ]; then
    not_passed "$label"
  elif grep -q 'SKIPPED:' "$step_log"; then
    local reason
    reason=$(grep -m1 -A2 'SKIPPED:' "$step_log" | oneline | sed 's/.*SKIPPED: *//')
    if [ $gpu_seen -eq 1 ]; then
      result FAILED "$label: skipped although nvidia-smi lists a GPU: $reason"
    else
      result SKIPPED "$label: $reason (its host-only cases passed)"
    fi
  else
    gpu_ran=1
    result PASSED "$label (ran on GPU)"
  fi
}

run_bench() {  # run_bench NAME TIMEOUT FILE ARGS...
  local name=$1 limit=$2 file=$3
  shift 3
  run_step "$name" "$limit" "$scratch/bench.json" "$bundle/$file" "$@"
  cat "$scratch/bench.json" >>"$json" 2>/dev/null
  if [ $rc -ne 0 ]; then
    not_passed "$name"
  elif grep -q '"skipped"' "$scratch/bench.json" && ! grep -q '"sizes"' "$scratch/bench.json"; then
    local reason
    reason=$(grep -m1 '"skipped"' "$scratch/bench.json" | sed 's/.*"skipped": *"\(.*\)",*$/\1/')
    if [ $gpu_seen -eq 1 ]; then
      result FAILED "$name: skipped although nvidia-smi lists a GPU: $reason"
    else
      result SKIPPED "$name: $reason"
    fi
  else
    result PASSED "$name (ran on GPU; JSON in benchmarks.json)"
  fi
  rm -f "$scratch/bench.json"
}

# run_python_ref NAME TIMEOUT SCRIPT ARGS...: a PyTorch reference of python/ with
# /opt/torch/.venv/bin/python (or $ZERORT_TORCH_PYTHON); its JSON goes to benchmarks.json.
run_python_ref() {
  local name=$1 limit=$2 script=$3 python=${ZERORT_TORCH_PYTHON:-/opt/torch/.venv/bin/python}
  shift 3
  if [ ! -x "$python" ]; then
    result SKIPPED "$name: no $python (set ZERORT_TORCH_PYTHON)"
    return
  fi
  if [ $gpu_seen -eq 0 ] && [ $gpu_ran -eq 0 ]; then
    result SKIPPED "$name: no GPU"
    return
  fi
  # torch brings its own NCCL and CUDA libraries.
  run_step "$name" "$limit" "$scratch/bench.json" env -u LD_LIBRARY_PATH "$python" \
    "$bundle/python/$script" "$@"
  cat "$scratch/bench.json" >>"$json" 2>/dev/null
  if [ $rc -ne 0 ]; then
    not_passed "$name"
  elif grep -q '"skipped"' "$scratch/bench.json"; then
    result SKIPPED "$name: $(grep -m1 '"skipped"' "$scratch/bench.json" | oneline)"
  else
    result PASSED "$name (ran on GPU; JSON in benchmarks.json)"
  fi
  rm -f "$scratch/bench.json"
}

run_torch_ref() {  # run_torch_ref TIMEOUT ELEMENTS...: torch's fused AdamW on those sizes
  local limit=$1
  shift
  run_python_ref "adamw_torch_ref $*" "$limit" adamw_torch_ref.py --elements "$@"
}

# The example GPT trained on the GPU by `zerort demo --device cuda` (GPT-2 124M shapes, byte
# vocabulary, 8 x 1024 tokens per step), then the same model in PyTorch (gpt_torch_ref.py) for
# tokens per second side by side. Without a GPU the demo must refuse cleanly, naming why.
run_demo() {  # run_demo TIMEOUT FILE STEPS
  local limit=$1 file=$2 steps=$3 name="//cli:zerort demo --device cuda"
  local corpus=()
  [ -f "$bundle/data/corpus.txt" ] && corpus=(--corpus "$bundle/data/corpus.txt")
  run_step "$name" "$limit" "" "$bundle/$file" demo --device cuda --steps "$steps" "${corpus[@]}"
  if [ $rc -ne 0 ] && [ $gpu_seen -eq 0 ] && grep -q 'no usable GPU' "$step_log"; then
    result SKIPPED "$name: $(grep -m1 'no usable GPU' "$step_log" | oneline)"
    return
  elif [ $rc -ne 0 ]; then
    not_passed "$name"
    return
  fi
  result PASSED "$name (ran on GPU: $(grep -m1 '^val loss' "$step_log" | oneline))"
  if [ $quick -eq 0 ] && [ -f "$bundle/data/demo_stage3_offload.json" ]; then
    local name3="//cli:zerort demo --device cuda --config demo_stage3_offload.json"
    run_step "$name3" "$limit" "" "$bundle/$file" demo --device cuda --steps 10 \
      --config "$bundle/data/demo_stage3_offload.json" "${corpus[@]}"
    if [ $rc -eq 0 ]; then
      result PASSED "$name3 (ran on GPU: $(grep -m1 '^val loss' "$step_log" | oneline))"
    else
      not_passed "$name3"
    fi
  fi
  run_python_ref gpt_torch_ref "$limit" gpt_torch_ref.py --steps "$steps"
  [ $quick -eq 1 ] && return
  # With torch's fused attention (flash): what zerort's written-out attention leaves behind.
  run_python_ref "gpt_torch_ref --sdpa" "$limit" gpt_torch_ref.py --steps "$steps" --sdpa
}

run_sanitizer() {  # run_sanitizer TOOL TIMEOUT LABEL FILE
  local tool=$1 limit=$2 label=$3 file=$4
  local name="$tool $label"
  if [ $gpu_seen -eq 0 ] && [ $gpu_ran -eq 0 ]; then
    result SKIPPED "$name: no GPU"
    return
  fi
  if [ -z "$sanitizer" ]; then
    result SKIPPED "$name: compute-sanitizer not found"
    return
  fi
  local extra=() filter=()
  # Intended API errors (an OOM on purpose, NCCL's start-up probes) are not memory errors.
  [ "$tool" = memcheck ] && extra=(--report-api-errors no --leak-check no)
  # racecheck and synccheck slow kernels down tens of times: test cases tagged [sanitizer_slow]
  # (whole training runs whose kernels the other cases already launch) run under memcheck only.
  # [no_sanitizer]: cases that measure the device itself (memory in use), which a sanitizer's
  # own allocations would distort, run under none.
  filter=("~[no_sanitizer]")
  [ "$tool" != memcheck ] && filter=("~[sanitizer_slow]~[no_sanitizer]")
  run_step "$name" "$limit" "" "$sanitizer" --tool "$tool" "${extra[@]}" --error-exitcode 86 \
    --print-limit 50 "$bundle/$file" "${filter[@]}"
  # racecheck ends with "RACECHECK SUMMARY: N hazards displayed", the others "ERROR SUMMARY".
  # (Not named `summary`: result() appends to the global of that name, the summary file.)
  local verdict
  verdict=$(grep -E '(RACECHECK|ERROR) SUMMARY' "$step_log" | sort -r | head -1 | sed 's/^=* *//')
  if [ $rc -eq 0 ]; then
    result PASSED "$name (ran on GPU: $verdict)"
  elif [ $rc -eq 86 ]; then
    result FAILED "$name: $verdict"
  else
    not_passed "$name"
  fi
}

if [ $quick -eq 1 ]; then test_limit=60; else test_limit=120; fi
for i in "${!test_labels[@]}"; do
  run_test "${test_labels[$i]}" "${test_files[$i]}" "$test_limit"
done

for f in "${demo_files[@]}"; do
  if [ $quick -eq 1 ]; then run_demo 60 "$f" 5; else run_demo 150 "$f" 30; fi
done

for i in "${!bench_labels[@]}"; do
  label=${bench_labels[$i]} file=${bench_files[$i]}
  if [ "${label##*:}" = cuda_bench ] && [ $quick -eq 0 ]; then
    # One process per size: the 1e9 run (the larger risk) cannot take the 1e8 figures with it.
    run_bench "$label --elements 1e8" 90 "$file" --elements 1e8
    run_bench "$label --elements 1e9" 120 "$file" --elements 1e9 --no-transfers
  elif [ $quick -eq 1 ]; then
    run_bench "$label --quick" 60 "$file" --quick
  elif [ "${label##*:}" = gpu_step_bench ]; then
    run_bench "$label" 120 "$file"
    # The step without the hand-off copies: gradients written into engine.grad(i), 1.3B only.
    run_bench "$label --shape 1.3b --grads engine" 75 "$file" --shape 1.3b --grads engine \
      --budget-s 45
    # The host's work per unit with the waits asleep (CUDA's spinning sync counts them as CPU).
    run_bench "$label --shape small --offload none --blocking-sync" 45 "$file" --shape small \
      --offload none --blocking-sync --budget-s 25
  else
    run_bench "$label" 120 "$file"
  fi
done

if [ $quick -eq 1 ]; then
  run_torch_ref 60 4194304
else
  run_torch_ref 120 1e8 1e9
fi

# memcheck on every engine/kernel test first (out-of-bounds and misaligned accesses are the
# likeliest bugs), then the shared-memory race and barrier checks, test by test.
for kt in "${kernel_tests[@]}"; do
  run_sanitizer memcheck 150 ${kt}
done
if [ $quick -eq 0 ]; then
  for kt in "${kernel_tests[@]}"; do
    run_sanitizer racecheck 150 ${kt}
    run_sanitizer synccheck 120 ${kt}
  done
fi

# The host SIMD kernels (AdamW, casts, norms), each bit for bit at every level this CPU has.
for i in "${!host_test_labels[@]}"; do
  label=${host_test_labels[$i]}
  run_step "$label" 60 "" "$bundle/${host_test_files[$i]}" --durations yes
  if [ $rc -ne 0 ]; then
    not_passed "$label"
  else
    result PASSED "$label (host CPU, every SIMD level up to $simd)"
  fi
done
for i in "${!host_bench_labels[@]}"; do
  label=${host_bench_labels[$i]} file=${host_bench_files[$i]}
  if [ $quick -eq 1 ]; then
    args=(--quick)
  else  # the compact forms against their floors, where the AVX2 machines were compute-bound
    args=(--forms=only --min_params=10000000 --max_params=100000000)
  fi
  run_step "$label ${args[*]}" 90 "$scratch/bench.json" "$bundle/$file" "${args[@]}"
  cat "$scratch/bench.json" >>"$json" 2>/dev/null
  if [ $rc -ne 0 ]; then
    not_passed "$label"
  else
    result PASSED "$label ${args[*]} (host CPU, SIMD $simd; JSON in benchmarks.json)"
  fi
  rm -f "$scratch/bench.json"
done

total="TOTAL: $passed passed, $skipped skipped, $failed failed in $((SECONDS - start))s"
if [ $gpu_seen -eq 0 ] && [ $gpu_ran -eq 0 ]; then total="$total (no GPU: nothing ran on one)"; fi
echo "$total" >>"$summary"
echo "$total"
logline "$total"
[ $failed -eq 0 ]
