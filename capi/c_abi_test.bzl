"""c_abi_test: a C11 test of the C ABI (zero_c.h), written in C against :zero_c and :c_check."""

def c_abi_test(name, linkopts = None, size = "small", **kwargs):
    """A cc_test of `<name>.c`, compiled as C11, against :zero_c and the checks of :c_check.

    Args:
      name: the test's name; its source is `<name>.c`.
      linkopts: as for cc_test (-lpthread for tests that start threads, -lm for libm).
      size: the test's size.
      **kwargs: forwarded to the cc_test.
    """
    native.cc_test(
        name = name,
        size = size,
        srcs = [name + ".c"],
        copts = ["-std=c11"],
        linkopts = linkopts,
        deps = [
            ":c_check",
            ":zero_c",
        ],
        **kwargs
    )
