#!/usr/bin/env bash
# Builds the consumer trainer against an installed zerort (tools/install.sh PREFIX), outside
# Bazel: with CMake's find_package (shared and static) and with make + pkg-config (shared and
# static); runs each on 2 in-process ranks and under mpirun -np 2; builds and runs llm.c's
# GPT-2 shape handing its gradient buffer over (llmc_trainer.c, make + pkg-config, in-process);
# checks that libzerort.so exports nothing but zr_*, and that the tree is self-contained: from an empty environment every
# library its ELF files load is inside PREFIX/lib or one every Linux machine has (glibc, the C++
# runtime), OpenMPI's libmpi (and what it loads) for the MPI plugin libzerort_mpi.so.0 alone;
# the CUDA runtime, liburing and NCCL are never loaded as libraries (linked in, or dlopen-ed at
# run time); and PREFIX/bin/zerort plans a model from that empty environment. Prints one "PASSED <check>" or "FAILED <check>" line per
# check (tools/test.sh counts them) and exits non-zero if any failed.
#
# Usage: tests/consumers/run.sh PREFIX
set -uo pipefail
prefix=$(cd "$1" && pwd)
here=$(cd "$(dirname "$0")" && pwd)
source "$here/../mpirun.sh"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
failed=0
result() {  # result <check> <status>
  if [ "$2" -eq 0 ]; then echo "PASSED $1"; else echo "FAILED $1"; failed=1; fi
}

# Exported symbols: zr_* only. Allowed besides: ZERORT_0, the version node of capi/zerort.lds,
# which nm lists as an absolute symbol (it names the symbol version; no code or data).
lib="$prefix/lib/libzerort.so.0"
extra=$(nm -D --defined-only "$lib" | awk '{print $NF}' | grep -v '^zr_' | grep -vx 'ZERORT_0')
count=$(nm -D --defined-only "$lib" | awk '{print $NF}' | grep -c '^zr_')
echo "libzerort.so.0 exports $count zr_* symbols; others: ${extra:-none}"
[ -z "$extra" ] && [ "$count" -gt 0 ]
result "exports-only-zr" $?
soname=$(readelf -d "$lib" | sed -n 's/.*(SONAME).*\[\(.*\)\]/\1/p')
[ "$soname" = libzerort.so.0 ]
result "soname-$soname" $?

# The closure of each installed ELF file, resolved from an empty environment (no
# LD_LIBRARY_PATH): inside PREFIX/lib, or glibc / the C++ runtime; libzerort_mpi.so.0 may also
# load OpenMPI (libmpi.so.40 and its own dependencies, resolved by the system). So a trainer that
# never calls zr_mpi_* loads libzerort.so.0 on a machine without MPI.
machine_lib() {
  case "$1" in
    linux-vdso.so.* | ld-linux-*.so.* | libc.so.* | libm.so.* | libpthread.so.* | libdl.so.* | \
      librt.so.* | libstdc++.so.* | libgcc_s.so.*) return 0 ;;
  esac
  return 1
}
mpi_plugin="$prefix/lib/libzerort_mpi.so.0"
mpi_lib=$(env -i PATH=/usr/bin:/bin ldd "$mpi_plugin" | awk '$1 ~ /^libmpi\.so/ {print $3}')
mpi_closure=" libmpi.so.40 $([ -n "$mpi_lib" ] && ldd "$mpi_lib" | awk '$2 == "=>" {print $1}' | tr '\n' ' ') "
libdir=$(readlink -f "$prefix/lib")
closure_ok() {  # closure_ok ELF [mpi]: prints each library that is not where it may be
  local name arrow path rest bad=0
  while read -r name arrow path rest; do
    [ "$arrow" = "=>" ] || continue
    machine_lib "$name" && continue
    [ "${2:-}" = mpi ] && [[ "$mpi_closure" == *" $name "* ]] && continue
    if [ "$path" = not ] || [ "$(dirname "$(readlink -f "$path")")" != "$libdir" ]; then
      echo "  $(basename "$1") loads $name from ${path/not/nowhere (not found)}"
      bad=1
    fi
  done < <(env -i PATH=/usr/bin:/bin ldd "$1")
  return $bad
}
closure_ok "$lib"
result "closure-libzerort" $?
closure_ok "$mpi_plugin" mpi
result "closure-libzerort_mpi" $?
closure_ok "$prefix/bin/zerort"
result "closure-bin-zerort" $?
st=0
for f in "$prefix"/lib/*.so.*; do
  [ "$f" = "$lib" ] || [ "$f" = "$mpi_plugin" ] || closure_ok "$f" || st=1
done
result "closure-bundled-libs" $st
needed=$(readelf -d "$lib" "$mpi_plugin" "$prefix/bin/zerort" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p' |
  grep -E '^lib(cudart|nccl|uring)\.' | sort -u)
echo "CUDA runtime, NCCL, liburing among NEEDED: ${needed:-none}"
[ -z "$needed" ]
result "no-cudart-nccl-uring-needed" $?
runpath=$(readelf -d "$lib" | sed -n 's/.*(RUNPATH).*\[\(.*\)\]/\1/p')
[ "$runpath" = '$ORIGIN' ]
result "runpath-origin" $?

# The command from an empty environment: its help, and a plan.
env -i PATH=/usr/bin:/bin "$prefix/bin/zerort" plan --help >"$work/plan-help.txt" 2>&1 &&
  grep -q 'usage: zerort plan' "$work/plan-help.txt"
result "bin-zerort-plan-help" $?
env -i PATH=/usr/bin:/bin "$prefix/bin/zerort" plan --model gpt2-124m --world 8 --stage 2 \
  >"$work/plan.txt" 2>&1
st=$?
head -5 "$work/plan.txt"
result "bin-zerort-plan" $st

# The header alone, as strict C99 and as C++.
echo '#include <zerort/zero_c.h>' >"$work/h.c"
gcc -std=c99 -pedantic -Wall -Wextra -Werror -fsyntax-only -I"$prefix/include" "$work/h.c" &&
  g++ -x c++ -std=c++11 -Wall -Wextra -Werror -fsyntax-only -I"$prefix/include" "$work/h.c"
result "header-c99-and-cxx" $?

run_trainer() {  # run_trainer <name> <binary>
  echo "== $1: 2 in-process ranks"
  timeout 300 "$2"
  result "$1-inprocess" $?
  echo "== $1: mpirun -np 2"
  timeout 300 mpirun "${MPIRUN_FLAGS[@]}" -np 2 "$2"
  result "$1-mpirun" $?
}

for kind in shared static; do
  static=OFF
  [ $kind = static ] && static=ON
  b="$work/cmake-$kind"
  if cmake -S "$here/cmake" -B "$b" -DCMAKE_PREFIX_PATH="$prefix" -DZERORT_STATIC=$static \
      >"$b.log" 2>&1 && cmake --build "$b" >>"$b.log" 2>&1; then
    result "cmake-$kind-build" 0
    run_trainer "cmake-$kind" "$b/trainer"
  else
    cat "$b.log"
    result "cmake-$kind-build" 1
  fi
done

for target in trainer trainer_static; do
  if PKG_CONFIG_PATH="$prefix/lib/pkgconfig" make -s -C "$here" OUT="$work" \
      "$work/$target" >"$work/$target.log" 2>&1; then
    result "pkgconfig-$target-build" 0
    run_trainer "pkgconfig-$target" "$work/$target"
  else
    cat "$work/$target.log"
    result "pkgconfig-$target-build" 1
  fi
done
# llm.c's GPT-2 shape handing its one gradient buffer over (llmc_trainer.c): the tensors reduced
# in place and the engine's gradient memory, handed over after Create and declared before the
# plan (zr_param_spec.grad_buffer); the masters of the two runs must be bitwise equal.
if PKG_CONFIG_PATH="$prefix/lib/pkgconfig" make -s -C "$here" OUT="$work" \
    "$work/llmc_trainer" >"$work/llmc_trainer.log" 2>&1; then
  result "pkgconfig-llmc_trainer-build" 0
  echo "== llmc_trainer: 2 in-process ranks"
  timeout 600 "$work/llmc_trainer" --steps 3
  result "llmc_trainer-inprocess" $?
else
  cat "$work/llmc_trainer.log"
  result "pkgconfig-llmc_trainer-build" 1
fi
# The installed tree moved elsewhere: pkg-config and CMake resolve the new place (prefix is
# relative to the .pc file and to zerortConfig.cmake), and the trainer loads the moved library.
moved="$work/moved/zerort"
mkdir -p "$work/moved" && cp -a "$prefix" "$moved"
loads_moved() {  # loads_moved <binary>: the dynamic loader resolves libzerort in the moved tree
  local lib
  lib=$(ldd "$1" | awk '/libzerort/ {print $3}')
  [ -n "$lib" ] && [ "$(readlink -f "$lib")" = "$(readlink -f "$moved/lib/libzerort.so.0")" ]
}
if PKG_CONFIG_PATH="$moved/lib/pkgconfig" make -s -C "$here" OUT="$work/moved" \
    "$work/moved/trainer" >"$work/moved.log" 2>&1 &&
    loads_moved "$work/moved/trainer"; then
  result "pkgconfig-relocated-build" 0
  echo "== pkgconfig-relocated: 2 in-process ranks"
  timeout 300 "$work/moved/trainer"
  result "pkgconfig-relocated-inprocess" $?
else
  cat "$work/moved.log"; ldd "$work/moved/trainer" 2>&1 | grep zerort
  result "pkgconfig-relocated-build" 1
fi
# The tree without its MPI plugin (as on a machine without OpenMPI, where libzerort_mpi.so.0
# cannot load): a trainer on in-process ranks runs, and zr_mpi_init fails naming the plugin.
nompi="$work/nompi/zerort"
mkdir -p "$work/nompi" && cp -a "$prefix" "$nompi" && rm "$nompi/lib/libzerort_mpi.so.0"
if PKG_CONFIG_PATH="$nompi/lib/pkgconfig" make -s -C "$here" OUT="$work/nompi" \
    "$work/nompi/trainer" >"$work/nompi.log" 2>&1; then
  echo "== no-mpi-plugin: 2 in-process ranks"
  timeout 300 "$work/nompi/trainer"
  result "no-mpi-plugin-inprocess" $?
  echo "== no-mpi-plugin: mpirun -np 1 (must fail, naming libzerort_mpi.so.0)"
  timeout 300 mpirun "${MPIRUN_FLAGS[@]}" -np 1 "$work/nompi/trainer" >"$work/nompi-mpi.log" 2>&1
  st=$?
  grep 'MPI setup' "$work/nompi-mpi.log"
  [ $st -ne 0 ] && grep -q 'MPI setup: .*libzerort_mpi.so.0' "$work/nompi-mpi.log"
  result "no-mpi-plugin-error-names-it" $?
else
  cat "$work/nompi.log"
  result "no-mpi-plugin-build" 1
fi
b="$work/cmake-relocated"
cmake -S "$here/cmake" -B "$b" -DCMAKE_PREFIX_PATH="$moved" >"$b.log" 2>&1 &&
  cmake --build "$b" >>"$b.log" 2>&1 && loads_moved "$b/trainer"
st=$?
[ $st -eq 0 ] || { cat "$b.log"; ldd "$b/trainer" 2>&1 | grep zerort; }
result "cmake-relocated-build" $st
exit $failed
