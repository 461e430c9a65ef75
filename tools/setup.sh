#!/usr/bin/env bash
# Installs what zerort's build and tests need on a fresh Debian bookworm machine (no-op when
# present), and starts the launch tests' Slurm cluster and torch venv (tests/launch/).
# Everything else comes from the machine: the CUDA toolkit under /usr/local/cuda.
set -euo pipefail
# clang-14 + libclang-rt-14-dev: the libFuzzer targets of tools/fuzz.sh (--config=fuzz).
# slurm-wlm, python3-venv: the launch tests under srun and torchrun (tests/launch/).
# liburing-dev: NVMe offload's io_uring I/O; fio: nvme_bench's reference measurement.
# patchelf: tools/gpu_bundle.sh and tools/install.sh set the copied binaries' RUNPATH.
packages=(bazel-bootstrap libabsl-dev catch2 openmpi-bin libopenmpi-dev nlohmann-json3-dev
          libbenchmark-dev clang-14 libclang-rt-14-dev python3-matplotlib
          slurm-wlm python3-venv liburing-dev fio patchelf)
missing=()
for p in "${packages[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}" >&2
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get install -y -q "${missing[@]}" >/dev/null ||
    { $sudo apt-get update -q >/dev/null && $sudo apt-get install -y -q "${missing[@]}" >/dev/null; }
fi
if [ ! -x /usr/local/cuda/bin/nvcc ]; then
  echo "setup: warning: /usr/local/cuda/bin/nvcc not found; CUDA targets will not build" >&2
fi
# The launch tests' launchers: a one-node Slurm cluster (srun_test) and torch from PyPI in a
# virtual environment (torchrun_test, about 2.5 minutes the first time). A failure here is
# reported by those tests, with the reason.
launch=$(dirname "$0")/../tests/launch
"$launch/slurm_cluster.sh" >/dev/null || echo "setup: warning: no Slurm cluster for srun_test" >&2
"$launch/torch_venv.sh" >/dev/null || echo "setup: warning: no torch venv for torchrun_test" >&2
