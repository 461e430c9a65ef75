#!/usr/bin/env bash
# Builds every GPU test and benchmark here (with Bazel) into DIR, a folder that runs without
# Bazel on a machine like the lent GPU one (docs/cuda.md, "Running on a GPU machine"):
#
#   DIR/run.sh            runs everything: DIR/run.sh OUT [--quick] (tools/gpu_bundle/run.sh)
#   DIR/manifest.txt      one line per target: "test|bench LABEL FILE FLAGS" or "excluded LABEL WHY"
#   DIR/bundle.txt        the commit and machine it was built from
#   DIR/bin/              the binaries, debug info stripped, RUNPATH $ORIGIN/../lib
#   DIR/lib/              every shared library they load except the C/C++ runtime (glibc,
#                         libstdc++, libgcc_s), the driver (libcuda.so.1, loaded by cudart) and
#                         NCCL (218 MB: run.sh takes the machine's, see there); RUNPATH $ORIGIN
#   DIR/runfiles/NAME/    a target's data files, when it has any (run.sh points TEST_SRCDIR there)
#   DIR/python/           benchmarks/adamw_torch_ref.py (torch's fused AdamW on the same sizes) and
#                         benchmarks/gpt_torch_ref.py (the demo's GPT in PyTorch)
#   DIR/data/corpus.txt   the demo's training text (the machine may lack /usr/share/common-licenses)
#
# The targets: every cc_test and cc_binary tagged gpu, plus every benchmark or example binary
# that links the CUDA device, and the `zerort` command (its `demo --device cuda` trains the example
# GPT on the GPU; manifest kind "demo"); minus those that link OpenMPI (it does not bundle: its MCA
# components are found through its install prefix), which manifest.txt lists as excluded. Also
# the host SIMD kernels' tests (tagged host_simd) and adamw_bench, flagged "host": the lent
# machines' CPUs may have AVX-512, which the build machines lack, so their AVX-512 paths run
# there (run.sh runs them last, on what is left of the time budget).
# Fails if the bundle exceeds 48 MiB: what may travel with a command is 64 MiB, the source tree
# about 4 MiB of it; the `zerort` command, with the demo's kernels, takes 9 MiB of the 38.
#
# Usage: tools/gpu_bundle.sh DIR   (DIR: absent, empty, or an earlier bundle, which is replaced)
# Needs patchelf (tools/setup.sh installs it).
set -euo pipefail

if [ $# -ne 1 ]; then
  echo "usage: $0 DIR" >&2
  exit 2
fi
root=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$1"
dir=$(cd "$1" && pwd)
if [ -n "$(ls -A "$dir")" ] && [ ! -f "$dir/manifest.txt" ]; then
  echo "gpu_bundle: $dir is neither empty nor an earlier bundle" >&2
  exit 2
fi
command -v patchelf >/dev/null || { echo "gpu_bundle: needs patchelf (tools/setup.sh)" >&2; exit 2; }
cd "$root"
readonly max_bytes=$((48 << 20))

# ---------------------------------------------------------------- targets
query() { bazel query --noshow_progress "$1" 2>/dev/null | sort; }
host_set='kind(cc_test, attr(tags, "\bhost_simd\b", //...)) + //benchmarks:adamw_bench'
candidates="kind(\"cc_(test|binary)\", attr(tags, \"\\bgpu\\b\", //...))
  + kind(cc_binary, rdeps(//benchmarks/... + //examples/..., //device:cuda_device))
  + //cli:zerort + $host_set"
mapfile -t all < <(query "$candidates")
mapfile -t host_targets < <(query "$host_set")
mapfile -t mpi < <(query "let c = $candidates in \$c intersect rdeps(\$c, @openmpi//:mpi)")
mapfile -t gpu_other < <(query 'attr(tags, "\bgpu\b", //...) except kind("cc_(test|binary)", //...)')
targets=()
for t in "${all[@]}"; do
  [[ " ${mpi[*]} " == *" $t "* ]] || targets+=("$t")
done
if [ ${#targets[@]} -eq 0 ]; then
  echo "gpu_bundle: no targets found (bazel query failed?)" >&2
  exit 1
fi
# The engine/kernel tests: those that run our kernels, for run.sh's compute-sanitizer passes.
mapfile -t kernel_tests < <(query "kind(cc_test, rdeps(set(${targets[*]}), //device:cuda_kernels))")
mapfile -t tests < <(query "kind(cc_test, set(${targets[*]}))")

echo "gpu_bundle: building ${targets[*]}" >&2
bazel build --noshow_progress "${targets[@]}" >&2

# ---------------------------------------------------------------- layout
rm -rf "$dir"/bin "$dir"/lib "$dir"/runfiles "$dir"/python "$dir"/data "$dir"/run.sh \
  "$dir"/manifest.txt "$dir"/bundle.txt
mkdir -p "$dir/bin" "$dir/lib" "$dir/python"
bin_dir=$(bazel info bazel-bin 2>/dev/null)

# The C/C++ runtime every Linux machine has, the driver and NCCL: never bundled.
is_machine_lib() {
  case "$1" in
    linux-vdso.so.* | ld-linux-*.so.* | libc.so.* | libm.so.* | libpthread.so.* | libdl.so.* | \
      librt.so.* | libstdc++.so.* | libgcc_s.so.* | libcuda.so.* | libnccl.so.*) return 0 ;;
  esac
  return 1
}

# Copies every library `ldd` resolves for ELF file $1 (as built, with Bazel's RUNPATH) into lib/.
copy_libs() {
  local name arrow path rest
  while read -r name arrow path rest; do
    [ "$arrow" = "=>" ] || continue
    is_machine_lib "$name" && continue
    if [ "$path" = "not" ]; then
      echo "gpu_bundle: $1 needs $name, which ldd does not find here" >&2
      exit 1
    fi
    [ -e "$dir/lib/$name" ] || cp -L "$path" "$dir/lib/$name"
  done < <(ldd "$1")
}

{
  echo "# Written by tools/gpu_bundle.sh; read by run.sh."
  echo "# test|bench LABEL FILE FLAGS (comma-separated, - for none; kernel: run under"
  echo "#   compute-sanitizer; runfiles: has data files in runfiles/NAME; host: runs on the CPU)"
  echo "# excluded LABEL WHY"
} >"$dir/manifest.txt"
for t in "${targets[@]}"; do
  rel=${t#//}
  pkg=${rel%%:*}
  name=${rel##*:}
  file="bin/$(echo "${pkg}_${name}" | tr '/' '_')"
  src="$bin_dir/$pkg/$name"
  cp -L "$src" "$dir/$file"
  copy_libs "$src"
  flags=()
  [[ " ${kernel_tests[*]} " == *" $t "* ]] && flags+=(kernel)
  [[ " ${host_targets[*]} " == *" $t "* ]] && flags+=(host)
  # Data files: whatever the runfiles tree holds beyond the binary and its libraries.
  if [ -d "$src.runfiles/zerort" ]; then
    data=$(cd "$src.runfiles/zerort" && find -L . -type f ! -path "./$pkg/$name" \
      ! -path './_solib_*' ! -name '*.so' ! -name '*.so.*' | sed 's|^\./||')
    if [ -n "$data" ]; then
      flags+=(runfiles)
      while read -r f; do
        mkdir -p "$(dirname "$dir/runfiles/$name/zerort/$f")"
        cp -L "$src.runfiles/zerort/$f" "$dir/runfiles/$name/zerort/$f"
      done <<<"$data"
    fi
  fi
  kind=bench
  [[ " ${tests[*]} " == *" $t "* ]] && kind=test
  [ "$t" = //cli:zerort ] && kind=demo
  f="${flags[*]:--}"
  echo "$kind $t $file ${f// /,}" >>"$dir/manifest.txt"
done
for t in "${mpi[@]}"; do
  echo "excluded $t links OpenMPI, which does not bundle: run it with Bazel and mpirun" \
    >>"$dir/manifest.txt"
done
for t in "${gpu_other[@]}"; do
  echo "excluded $t is not a cc_test or cc_binary (a script under a launcher)" \
    >>"$dir/manifest.txt"
done

# ---------------------------------------------------------------- strip, RUNPATH
chmod -R u+w "$dir/bin" "$dir/lib"
for f in "$dir"/bin/* "$dir"/lib/*; do
  strip --strip-debug "$f"
done
for f in "$dir"/bin/*; do patchelf --set-rpath '$ORIGIN/../lib' "$f"; done
for f in "$dir"/lib/*; do patchelf --set-rpath '$ORIGIN' "$f"; done

cp tools/gpu_bundle/run.sh "$dir/run.sh"
cp benchmarks/adamw_torch_ref.py benchmarks/gpt_torch_ref.py "$dir/python/"
# The demo's training text (examples/gpt/corpus.cc's default), for a machine that lacks it.
mkdir -p "$dir/data"
cp /usr/share/common-licenses/GPL-3 "$dir/data/corpus.txt"
# The demo's GPU config (cli/demo.cc) at stage 3 with the optimizer state on the CPU: the GPU
# path's other end (parameter gathers, host AdamW, offload transfers).
cat >"$dir/data/demo_stage3_offload.json" <<'JSON'
{
  "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": true}},
  "bf16": {"enabled": true},
  "optimizer": {"type": "AdamW", "params": {"lr": 0.0006, "weight_decay": 0.1}},
  "gradient_clipping": 1.0,
  "comm_timeout_ms": 600000
}
JSON
chmod +x "$dir/run.sh"
{
  echo "commit: $(git rev-parse --short HEAD)$(git diff --quiet HEAD -- 2>/dev/null || echo ' (with uncommitted changes)')"
  echo "built: $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(uname -m), $(ldd --version | head -1)"
  echo "nvcc: $(/usr/local/cuda/bin/nvcc --version | tail -1)"
} >"$dir/bundle.txt"

bytes=$(du -sb "$dir" | cut -f1)
echo "gpu_bundle: $dir: $(grep -cE '^(test|bench) ' "$dir/manifest.txt") binaries, $(ls "$dir/lib" | wc -l) libraries, $((bytes >> 10)) KiB" >&2
if [ "$bytes" -gt "$max_bytes" ]; then
  echo "gpu_bundle: $dir is $bytes bytes, over the $max_bytes-byte limit" >&2
  exit 1
fi
