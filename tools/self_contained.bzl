"""Link options for the installed binaries (tools/install.sh): libzerort.so.0 and `zerort`.

They carry liburing and the CUDA runtime inside them (static archives, position-independent),
so that an install tree loads on a machine that has neither, without the build machine's paths.
Abseil stays shared (Debian's libabsl_*.a are not built with -fPIC): tools/install.sh copies its
.so files into PREFIX/lib. The archives come before the -l flags of the dependencies (Bazel puts a
binary's linkopts first), so every symbol resolves from them, and --as-needed then drops the
shared libraries nothing refers to any more. NCCL is not linked at all: such a binary also
depends on //comm:nccl_dlopen, which loads it at run time (comm/nccl_dlopen.h).
"""


SELF_CONTAINED_LINKOPTS = [
    "-Wl,--as-needed",
    "-Wl,--start-group",
    "/usr/lib/x86_64-linux-gnu/liburing.a",
    "/usr/local/cuda/lib64/libcudart_static.a",
    "-Wl,--end-group",
    # What the static CUDA runtime needs (glibc).
    "-ldl",
    "-lrt",
    "-lpthread",
]
