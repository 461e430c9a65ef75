"""mpi_test: a test binary run under mpirun, as the pair of targets every MPI test needs.

`<name>_bin` is the cc_binary (testonly; its main is usually //comm:mpi_test_main), and `<name>`
the sh_test whose script `<name>.sh` sources tests/mpirun.sh and launches the binary, given as
its first argument, at the world sizes it names.
"""

def mpi_test(name, srcs, deps, size = "medium", **kwargs):
    """The test binary `<name>_bin` and the sh_test `<name>` that runs it under mpirun.

    Args:
      name: the sh_test's name; the script is `<name>.sh`.
      srcs: the binary's sources.
      deps: the binary's dependencies.
      size: the sh_test's size.
      **kwargs: forwarded to the sh_test (tags, timeout, ...).
    """
    binary = name + "_bin"
    native.cc_binary(
        name = binary,
        testonly = True,
        srcs = srcs,
        deps = deps,
    )
    native.sh_test(
        name = name,
        size = size,
        srcs = [name + ".sh"],
        args = ["$(location :%s)" % binary],
        data = [":" + binary],
        deps = ["//tests:mpirun"],
        **kwargs
    )
