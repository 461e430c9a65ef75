#!/usr/bin/env bash
# llm.c's GPT-2 shape with its gradients in one buffer of its own (llmc_trainer.c) on 2
# in-process ranks (per-tensor units at stage 2, per-layer slices at stage 0), then as 2 MPI
# processes (stage 1). Each run trains twice (the buffer handed over after Create, then declared
# before the plan) and fails unless the masters are bitwise equal and the declaration saves
# gradient memory.
set -euo pipefail
source "$(dirname "$0")/../mpirun.sh"
"$1" --stage 2 --steps 2
"$1" --stage 0 --layout layers --steps 2
mpi_run 600 -np 2 "$1" --stage 1 --steps 2
