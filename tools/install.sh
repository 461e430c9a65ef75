#!/usr/bin/env bash
# Builds libzerort with Bazel and installs it for trainers built with CMake, pkg-config or by
# hand, outside this tree:
#   PREFIX/include/zerort/zero_c.h                 the C ABI (self-contained C99)
#   PREFIX/lib/libzerort.so.MAJOR, libzerort.so     exports only zr_* (capi/zerort.lds); RUNPATH
#                                                   $ORIGIN; liburing and the CUDA runtime linked
#                                                   in, NCCL loaded at run time (comm/nccl_dlopen.h)
#   PREFIX/lib/libzerort_mpi.so.MAJOR                zr_mpi_*, loaded by libzerort at the first
#                                                   such call; the one file that needs OpenMPI
#   PREFIX/lib/libabsl_*.so.20220623                the Abseil libraries they and bin/zerort load
#   PREFIX/bin/zerort                               the command (plan, demo, ckpt); RUNPATH
#                                                   $ORIGIN/../lib
#   PREFIX/bin/zerort_c_smoke                       tests/consumers/gpu_trainer.c, for
#                                                   tests/consumers/gpu_smoke.sh on a GPU machine
#   PREFIX/lib/libzerort.a                          the same objects with MPI linked in, for static
#                                                   linking
#   PREFIX/lib/pkgconfig/zerort.pc                  pkg-config --cflags --libs [--static] zerort
#   PREFIX/lib/cmake/zerort/zerortConfig.cmake      find_package(zerort): zerort::zerort,
#   PREFIX/lib/cmake/zerort/zerortConfigVersion.cmake       zerort::zerort_static
# Only the C ABI is installed: the C++ headers depend on this tree's layout and on the exact
# Abseil build, so C++ trainers outside Bazel use the C ABI too (docs/embedding.md).
# The tree needs nothing of the build machine but OpenMPI's libmpi.so.40 (libzerort_mpi only):
# every other library is inside PREFIX/lib or part of glibc and the C++ runtime
# (tests/consumers/run.sh checks it from an empty environment). NCCL is found at run time
# (docs/embedding.md).
#
# Usage: tools/install.sh PREFIX
# Needs patchelf (tools/setup.sh installs it).
set -euo pipefail
if [ $# -ne 1 ]; then
  echo "usage: $0 PREFIX" >&2
  exit 2
fi
mkdir -p "$1"
prefix=$(cd "$1" && pwd)
cd "$(dirname "$0")/.."
command -v patchelf >/dev/null || { echo "install: needs patchelf (tools/setup.sh)" >&2; exit 2; }

bazel build //capi:libzerort.so.0 //capi:libzerort_mpi.so.0 //capi:libzerort_archive.so \
  //cli:zerort_installed 2>&1 | grep -v 'linux-sandbox' >&2
execroot=$(bazel info execution_root 2>/dev/null)
bin=$(bazel info bazel-bin 2>/dev/null)
params="$bin/capi/libzerort_archive.so-2.params"

ver() { sed -n "s/^#define ZR_VERSION_$1 \([0-9]*\)$/\1/p" capi/zero_c.h; }
major=$(ver MAJOR)
version="$major.$(ver MINOR).$(ver PATCH)"

install -d "$prefix/include/zerort" "$prefix/lib/pkgconfig" "$prefix/lib/cmake/zerort" \
  "$prefix/bin"
install -m 644 capi/zero_c.h "$prefix/include/zerort/zero_c.h"
rm -f "$prefix/lib/libzerort.so.$major" "$prefix/lib/libzerort.so" \
  "$prefix/lib/libzerort_mpi.so.$major"
install -m 755 "$bin/capi/libzerort.so.$major" "$prefix/lib/libzerort.so.$major"
install -m 755 "$bin/capi/libzerort_mpi.so.$major" "$prefix/lib/libzerort_mpi.so.$major"
ln -s "libzerort.so.$major" "$prefix/lib/libzerort.so"
rm -f "$prefix/bin/zerort"
install -m 755 "$bin/cli/zerort_installed" "$prefix/bin/zerort"
strip --strip-debug "$prefix/lib/libzerort.so.$major" "$prefix/lib/libzerort_mpi.so.$major" \
  "$prefix/bin/zerort"

# The shared libraries they load that are neither glibc, the C++ runtime nor OpenMPI and what it
# loads (that is: Abseil): copied next to libzerort, found through RUNPATH $ORIGIN. Bazel's
# RUNPATH (the build machine's /usr/local/cuda/lib64) is replaced.
mpi_closure=" $(ldd "$(ldd "$bin/capi/libzerort_mpi.so.$major" | awk '$1 ~ /^libmpi\.so/ {print $3}')" |
  awk '$2 == "=>" {print $1}' | tr '\n' ' ') "
copy_libs() {  # copy_libs ELF
  local name arrow path rest
  while read -r name arrow path rest; do
    [ "$arrow" = "=>" ] || continue
    [[ "$mpi_closure" == *" $name "* ]] && continue
    case "$name" in
      linux-vdso.so.* | ld-linux-*.so.* | libc.so.* | libm.so.* | libpthread.so.* | libdl.so.* | \
        librt.so.* | libstdc++.so.* | libgcc_s.so.* | libmpi.so.* | libzerort.so.*) continue ;;
    esac
    if [ "$path" = not ]; then
      echo "install: $1 needs $name, which is not found here" >&2
      exit 1
    fi
    rm -f "$prefix/lib/$name"
    cp -L "$path" "$prefix/lib/$name"
    chmod 755 "$prefix/lib/$name"
    patchelf --set-rpath '$ORIGIN' "$prefix/lib/$name"
  done < <(ldd "$1")
}
copy_libs "$bin/capi/libzerort.so.$major"
copy_libs "$bin/capi/libzerort_mpi.so.$major"
copy_libs "$bin/cli/zerort_installed"
patchelf --set-rpath '$ORIGIN' "$prefix/lib/libzerort.so.$major"
patchelf --set-rpath '$ORIGIN' "$prefix/lib/libzerort_mpi.so.$major"
patchelf --set-rpath '$ORIGIN/../lib' "$prefix/bin/zerort"

# The GPU smoke test's C program, built here against the tree just installed: the machine it is
# meant for may have no compiler (tests/consumers/gpu_smoke.sh).
rm -f "$prefix/bin/zerort_c_smoke"
${CC:-cc} -std=c99 -O2 -I"$prefix/include" tests/consumers/gpu_trainer.c \
  -o "$prefix/bin/zerort_c_smoke" -L"$prefix/lib" -lzerort -ldl -lm -Wl,-rpath,'$ORIGIN/../lib'

# The static archive: every object that //capi:libzerort_archive.so's link saw (its params file:
# the C ABI with MPI linked in, and NCCL as -lnccl), renamed after its path so that equal
# basenames from different packages do not collide. A static link takes the system's MPI, NCCL,
# CUDA runtime, liburing and Abseil shared libraries from Libs.private, as before.
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
n=0
while read -r obj; do
  n=$((n + 1))
  cp "$execroot/$obj" "$work/$(printf '%03d' $n)_$(basename "$obj" | sed 's/\.pic\.o$/.o/')"
done < <(grep -E '^[^-].*\.o$' "$params")
rm -f "$prefix/lib/libzerort.a"
ar rcs "$prefix/lib/libzerort.a" "$work"/*.o

# What a static link needs besides the archive, in the order the shared library was linked:
# MPI, NCCL, the CUDA runtime, Abseil (shared, from the system), libstdc++.
private=$(grep -E '^-(l|L|Wl,-rpath,)' "$params" | awk '!seen[$0]++' | tr '\n' ' ')
private=${private% }

# prefix is relative to the .pc file itself (pkgconf's pcfiledir), so an installed tree can be
# moved or copied (a container image, a shared filesystem mounted elsewhere) and still resolve.
cat >"$prefix/lib/pkgconfig/zerort.pc" <<PC
prefix=\${pcfiledir}/../..
libdir=\${prefix}/lib
includedir=\${prefix}/include

Name: zerort
Description: ZeRO-style sharded optimizer runtime (C ABI)
Version: $version
Cflags: -I\${includedir}
Libs: -L\${libdir} -lzerort
Libs.private: $private
PC

cat >"$prefix/lib/cmake/zerort/zerortConfig.cmake" <<CMAKE
# zerort $version: find_package(zerort) defines
#   zerort::zerort         the shared library (exports only zr_*)
#   zerort::zerort_static  the static archive with the libraries it needs
get_filename_component(_zerort_prefix "\${CMAKE_CURRENT_LIST_DIR}/../../.." ABSOLUTE)
if(NOT TARGET zerort::zerort)
  add_library(zerort::zerort SHARED IMPORTED)
  set_target_properties(zerort::zerort PROPERTIES
    IMPORTED_LOCATION "\${_zerort_prefix}/lib/libzerort.so.$major"
    IMPORTED_SONAME "libzerort.so.$major"
    INTERFACE_INCLUDE_DIRECTORIES "\${_zerort_prefix}/include")
  add_library(zerort::zerort_static STATIC IMPORTED)
  set_target_properties(zerort::zerort_static PROPERTIES
    IMPORTED_LOCATION "\${_zerort_prefix}/lib/libzerort.a"
    IMPORTED_LINK_INTERFACE_LANGUAGES "CXX"
    INTERFACE_INCLUDE_DIRECTORIES "\${_zerort_prefix}/include"
    INTERFACE_LINK_LIBRARIES "$private")
endif()
set(zerort_VERSION $version)
unset(_zerort_prefix)
CMAKE

cat >"$prefix/lib/cmake/zerort/zerortConfigVersion.cmake" <<CMAKE
# Compatible when the major version matches and the installed version is not older.
set(PACKAGE_VERSION $version)
if(PACKAGE_FIND_VERSION_MAJOR STREQUAL "$major" AND
   NOT PACKAGE_VERSION VERSION_LESS PACKAGE_FIND_VERSION)
  set(PACKAGE_VERSION_COMPATIBLE TRUE)
  if(PACKAGE_FIND_VERSION STREQUAL PACKAGE_VERSION)
    set(PACKAGE_VERSION_EXACT TRUE)
  endif()
else()
  set(PACKAGE_VERSION_COMPATIBLE FALSE)
endif()
CMAKE

echo "installed zerort $version into $prefix"
