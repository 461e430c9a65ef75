"""cuda_library: compiles .cu files with the toolkit's nvcc into a cc_library.

Host .cc files never see device code: a kernel lives in a .cu, its launcher is declared in a plain
C++ header listed in `hdrs`, and C++ targets depend on the result like any cc_library. The
objects carry SASS for sm_80 and sm_90 and PTX for compute_90, so newer GPUs JIT from PTX.
"""

_NVCC = "/usr/local/cuda/bin/nvcc"

_GENCODE = " ".join([
    "-gencode=arch=compute_80,code=sm_80",
    "-gencode=arch=compute_90,code=sm_90",
    "-gencode=arch=compute_90,code=compute_90",
])

def cuda_library(name, srcs, hdrs = [], deps = [], device_hdrs = [], copts = [], visibility = None, linkstatic = True, **kwargs):
    """A cc_library whose srcs are CUDA files compiled by nvcc.

    Args:
      name: target name.
      srcs: .cu files.
      hdrs: plain C++ headers declaring the launchers (no device code).
      deps: cc_library dependencies of the resulting library.
      device_hdrs: headers from other targets that the .cu files include (nvcc sees only these).
      copts: extra nvcc flags.
      visibility: as for cc_library.
      linkstatic: as for cc_library. False makes one shared library that every binary loads,
        where True links the kernels (and their device code for every architecture) into each.
      **kwargs: forwarded to the cc_library.
    """
    objs = []
    for src in srcs:
        stem = src.replace("/", "_").rsplit(".", 1)[0]
        obj = "_%s_%s.o" % (name, stem)
        native.genrule(
            name = "%s_%s_nvcc" % (name, stem),
            srcs = [src] + hdrs + device_hdrs + ["@cuda//:headers"],
            outs = [obj],
            cmd = " ".join([
                _NVCC,
                "-std=c++17 -O3 -Xcompiler -fPIC --expt-relaxed-constexpr",
                _GENCODE,
                "-I. -I$(GENDIR)",
                " ".join(copts),
                "-c $(location %s) -o $@" % src,
            ]),
            tags = ["cuda"],
        )
        objs.append(obj)
    native.cc_library(
        name = name,
        srcs = objs,
        hdrs = hdrs,
        deps = deps + ["@cuda//:cudart"],
        linkstatic = linkstatic,
        visibility = visibility,
        **kwargs
    )
