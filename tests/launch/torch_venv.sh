#!/usr/bin/env bash
# Makes (or checks) the virtual environment with torch from PyPI whose torchrun the launch test
# (tests/launch/torchrun_test.sh) runs, with safetensors and numpy for the safetensors check: $ZERORT_TORCH_VENV, default ~/.cache/zerort/venv-torch.
# Smallest install that starts torchrun: `pip install --no-deps torch`, then torch's own
# requirements except triton (1 GB of GPU compiler) and cuda-bindings, which torchrun never
# imports. The CUDA libraries stay (torch's extension module links them: import fails without
# them), about 4 GB; a fresh install takes about 2.5 minutes on the development VM. On success
# prints the venv's path; on failure writes the reason to $venv.failed (the test reads it to say
# why it skips) and exits 1.
set -uo pipefail
home=${HOME:-$(getent passwd "$(id -u)" | cut -d: -f6)}
venv=${ZERORT_TORCH_VENV:-$home/.cache/zerort/venv-torch}
version=${ZERORT_TORCH_VERSION:-2.15.0}
stamp=$venv/.zerort-torch-$version
fail() {
  mkdir -p "$(dirname "$venv")"
  echo "$1" >"$venv.failed"
  echo "torch_venv: $1" >&2
  exit 1
}
# The safetensors check (tests/safetensors/hf_check_test.sh) reads and writes files with these;
# a venv made before they were added gets them without being rebuilt.
extras=("safetensors==0.7.0" "numpy==2.3.5")
install_extras() {
  local out
  out=$("$venv/bin/python" -m pip install -q --disable-pip-version-check "${extras[@]}" 2>&1) ||
    fail "pip install ${extras[*]} failed: $(tail -3 <<<"$out" | tr '\n' ' ')"
}
if [ -f "$stamp" ] && "$venv/bin/torchrun" --help >/dev/null 2>&1; then
  "$venv/bin/python" -c 'import numpy, safetensors' 2>/dev/null || install_extras
  echo "$venv"
  exit 0
fi
rm -rf "$venv" "$venv.failed"
mkdir -p "$(dirname "$venv")"
python3 -m venv "$venv" >/dev/null 2>&1 || fail "python3 -m venv failed (install python3-venv)"
pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check)
# Not quiet: pip reports connection failures only as warnings, which -q hides. An index that
# lists no torch at all ("from versions: none") is one pip could not reach; a missing version
# lists the others and is a real failure.
if ! out=$("$venv/bin/python" -m pip install --disable-pip-version-check --no-deps \
           "torch==$version" 2>&1); then
  if grep -qiE 'from versions: none|NewConnectionError|ConnectTimeout|Network is unreachable' \
       <<<"$out"; then
    fail "no network: pip could not fetch torch==$version from PyPI: $(tail -1 <<<"$out")"
  fi
  fail "pip install torch==$version failed: $(tail -3 <<<"$out" | tr '\n' ' ')"
fi
# torch's requirements for this platform, without the two torchrun does not need.
deps=$("$venv/bin/python" - <<'PY'
import importlib.metadata as metadata
from pip._vendor.packaging.requirements import Requirement
for line in metadata.requires("torch") or []:
    req = Requirement(line)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    if req.name in ("triton", "cuda-bindings"):
        continue
    extras = "[" + ",".join(sorted(req.extras)) + "]" if req.extras else ""
    print(f"{req.name}{extras}{req.specifier}")
PY
) || fail "could not read torch's requirements"
# shellcheck disable=SC2086
out=$("${pip[@]}" $deps 2>&1) ||
  fail "pip install of torch's requirements failed: $(tail -3 <<<"$out" | tr '\n' ' ')"
install_extras
out=$("$venv/bin/torchrun" --help 2>&1) ||
  fail "torchrun does not start: $(tail -2 <<<"$out" | tr '\n' ' ')"
touch "$stamp"
echo "$venv"
