"""zerort_fuzzer: one libFuzzer entry point, two builds and a corpus test."""

def zerort_fuzzer(name, srcs, deps, corpus):
    """Declares a fuzz target and the test that replays its corpus.

    `name` is a libFuzzer binary under --config=fuzz (tools/fuzz.sh runs it for a bounded time);
    in every other configuration the same entry point links tests/fuzz/replay_main.cc instead.
    `name + "_corpus_test"` replays `corpus` (a tests/fuzz/<target> folder: the seeds and any
    crash input kept there) in `bazel test //...`.

    Args:
      name: the target's name, e.g. "config_fuzzer".
      srcs: the file defining LLVMFuzzerTestOneInput.
      deps: the libraries it fuzzes.
      corpus: the folder's name under tests/fuzz/.
    """
    native.cc_binary(
        name = name,
        srcs = srcs,
        deps = deps + select({
            "//tests/fuzz:fuzzing": [],
            "//conditions:default": ["//tests/fuzz:replay_main"],
        }),
        linkopts = select({
            "//tests/fuzz:fuzzing": ["-fsanitize=fuzzer"],
            "//conditions:default": [],
        }),
    )
    native.sh_test(
        name = name + "_corpus_test",
        size = "small",
        srcs = ["//tests/fuzz:replay.sh"],
        args = ["$(location :%s)" % name, "tests/fuzz/" + corpus],
        data = [":" + name, "//tests/fuzz:" + corpus + "_corpus"],
    )
