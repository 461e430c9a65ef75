#!/usr/bin/env bash
# replay.sh FUZZER CORPUS_DIR: runs a fuzz target's replay build over its corpus (fuzz.bzl).
exec "$1" "$2"
