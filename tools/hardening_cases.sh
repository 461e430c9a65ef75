#!/bin/bash
# The bad inputs of issue 13 at the command line, against a given `zerort` binary, classified:
#
#   tools/hardening_cases.sh ZERORT [--maker ZERORT2] [--verbose]
#
# Every case runs in a fresh directory under a 20 s timeout, and ends in one of
#   refused    exit 1 or 2 with a message on stderr (the expected answer to a bad input)
#   accepted   exit 0 where that is the right answer (e.g. `plan --help`, `--budget 1e-3GiB`)
#   crash      killed by a signal (an uncaught exception aborts: exit 134)
#   hang       still running at the timeout
#   wrong      exit 0 where the input must be refused, a negative size printed, a refusal of a
#              valid input, or bytes the command must not print (a file `latest` points to,
#              an escape sequence)
#   data-loss  a file that must survive was changed or removed, or a temporary was left
# and the counts are printed last. The fixture checkpoint (2 ranks, the demo GPT) is made once
# with `MAKER demo --checkpoint` (MAKER defaults to ZERORT; an old ZERORT without that flag
# needs a newer MAKER; the checkpoint format is the same). Manifests are edited in Python, their
# CRC32C recomputed, so the hostile values reach the checks behind the checksum.
#
# Bootstrap cases are the in-process ranks of `zerort demo` (--ranks); the MPI and rendezvous
# bootstrap (timeouts, secret) are not reachable from `zerort` and are covered by
# //comm:mpi_test, //comm:mpi_init_test and //comm:rendezvous_test.
set -uo pipefail

usage() { echo "usage: $0 ZERORT [--maker ZERORT] [--verbose]" >&2; exit 2; }
[[ $# -ge 1 ]] || usage
bin=$(realpath "$1")
shift
maker="${bin}"
verbose=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --maker) maker=$(realpath "$2"); shift 2 ;;
    --verbose) verbose=1; shift ;;
    *) usage ;;
  esac
done
[[ -x "${bin}" && -x "${maker}" ]] || usage

top=$(mktemp -d /tmp/zrharden.XXXXXX)
trap 'chmod -R u+w "${top}" 2>/dev/null; rm -rf "${top}"' EXIT
declare -A count=([refused]=0 [accepted]=0 [crash]=0 [hang]=0 [wrong]=0 [data-loss]=0)
tried=0

# The fixture: a real checkpoint with two steps.
fixture="${top}/fixture"
mkdir -p "${fixture}"
(cd "${fixture}" && "${maker}" demo --steps 2 --ranks 2 --checkpoint ck --checkpoint_every 1 \
  >/dev/null 2>&1 && rm -rf ck/step_1) ||
  { echo "cannot make the fixture checkpoint with ${maker}" >&2; exit 2; }

# edit_manifest FILE PYTHON: runs PYTHON on `m` (the manifest as a dict), then rewrites FILE
# with the checksum the writer would compute (compact dump of everything else, key order kept).
edit_manifest() {
  python3 - "$1" "$2" <<'EOF'
import json, sys
def crc32c(data):
    crc = 0xffffffff
    for b in data:
        crc ^= b
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xffffffff
path, code = sys.argv[1], sys.argv[2]
m = json.load(open(path))
m.pop("manifest_crc32c", None)
exec(code)
body = json.dumps(m, separators=(",", ":"), ensure_ascii=False)
m["manifest_crc32c"] = crc32c(body.encode("utf-8", "surrogateescape"))
open(path, "w", encoding="utf-8", errors="surrogateescape").write(json.dumps(m, ensure_ascii=False))
EOF
}

# Case state: each case gets a fresh directory holding a copy of the fixture as `ck`.
new_case() {
  dir="${top}/case$((tried + 1))"
  mkdir -p "${dir}"
  cp -a "${fixture}/ck" "${dir}/ck"
  cd "${dir}" || exit 2
}

sums() { find "$@" -type f -print0 2>/dev/null | sort -z | xargs -0 -r md5sum; }

# run EXPECT NAME CMD...: EXPECT is refuse, accept or either (exact or refused). Leaves rc, out (stdout+stderr) and the
# category in `verdict`; a check after it may still turn the verdict into wrong or data-loss.
run() {
  local expect="$1" name="$2"
  shift 2
  tried=$((tried + 1))
  case_name="${name}"
  { timeout -k 5 20 "$@" >"${top}/out" 2>&1 </dev/null; } 2>/dev/null
  rc=$?
  out=$(tr -d '\0' <"${top}/out")
  if [[ ${rc} -eq 124 || ${rc} -eq 137 ]]; then
    verdict=hang
  elif [[ ${rc} -ge 128 ]]; then
    verdict=crash
  elif [[ ${rc} -ne 0 ]]; then
    # A refusal is clean when it says something and is not an uncaught exception.
    if [[ ${expect} != accept && -n "${out}" && "${out}" != *"terminate called"* ]]; then
      verdict=refused
    else
      verdict=wrong
    fi
  elif [[ ${expect} == refuse ]]; then
    verdict=wrong
  else
    verdict=accepted
  fi
  if [[ ${rc} -eq 0 ]] && grep -Eq '(^|[ :])-[0-9]+(\.[0-9]+)? ?(B|KiB|MiB|GiB|TiB|PiB|bytes|params)|": -[0-9]' \
      <<<"${out}"; then
    verdict=wrong  # a negative size
  fi
}
# Marks the current case; call after run and any checks.
done_case() {
  count[${verdict}]=$((count[${verdict}] + 1))
  if [[ ${verbose} -eq 1 || ${verdict} == crash || ${verdict} == hang || ${verdict} == wrong ||
        ${verdict} == data-loss ]]; then
    printf '%-10s rc=%-3s %s: %s\n' "${verdict}" "${rc}" "${case_name}" \
      "$(head -c 160 <<<"${out}" | tr '\n\033' ' ?')"
  fi
  cd "${top}" && chmod -R u+w "${dir}" && rm -rf "${dir}"
}
worse() { if [[ ${verdict} != crash && ${verdict} != hang ]]; then verdict="$1"; fi; }

# ---- plan ---------------------------------------------------------------------------------
plan_refuse() { new_case; run refuse "plan $*" "${bin}" plan "$@"; done_case; }
plan_accept() { new_case; run accept "plan $*" "${bin}" plan "$@"; done_case; }

plan_refuse --params 2e9 --layers 2e9
plan_refuse --params 1e18 --layers 1000
plan_refuse --params 1e18 --layers 1000 --stage auto --budget 1GiB
plan_refuse --params 1e18 --layers 1000 --json
plan_refuse --params 1e9 --world 4294967297
plan_refuse --params 1e9 --layers 4294967297
plan_refuse --params 1e9 --world 2 --rank 4294967296
plan_refuse --params 1e9 --world 0
plan_refuse --params 1e9 --world 4 --rank 4
plan_refuse --params 1e9 --world -1
for v in 9223372036854775808 9.3e18 1e300 nan inf -1 1.5 0 '' 12abc; do
  plan_refuse --params "${v}"
done
plan_refuse --params 1e9 --layers 0
plan_refuse --params 1e9 --layers 1e300
plan_refuse --params 1e9 --stage 7
plan_refuse --params 1e9 --stage -1
plan_refuse --params 1e9 --offload bogus
plan_refuse --params 1e9 --precision fp8
plan_refuse --params 1e9 --stage auto --budget device=1GiB=junk
plan_refuse --params 1e9 --stage auto --budget device=1GiB,device=2GiB
plan_refuse --params 1e9 --stage auto --budget 0.3
plan_refuse --params 1e9 --stage auto --budget 1e-10GiB
plan_refuse --params 1e9 --stage auto --budget -1GiB
plan_refuse --params 1e9 --stage auto --budget 1e400GiB
plan_accept --params 1e6 --layers 4 --stage auto --budget 1.5e-1GiB
plan_accept --help
plan_accept --params 1e9 --help
plan_refuse --wrld 4
plan_refuse --model no-such-model
plan_refuse --model gpt2-124m --config /dev/zero
plan_refuse --model /dev/zero
plan_refuse --model gpt2-124m --config /nonexistent.json
plan_accept --params 1e12 --world 2147483647

# Files: config and model files with hostile content.
file_case() {  # file_case EXPECT NAME FLAG CONTENT-COMMAND...
  local expect="$1" name="$2" flag="$3"
  shift 3
  new_case
  "$@" >input.json
  run "${expect}" "plan ${flag} <${name}>" "${bin}" plan --params 1e9 "${flag}" input.json
  done_case
}
file_case refuse "NUL after the JSON" --config printf '{"train_batch_size": 8}\0junk'
file_case refuse "not JSON" --config printf 'stage: 3\n'
file_case refuse "empty" --config printf ''
file_case refuse "an array" --config printf '[]'
file_case refuse "100000 nested arrays" --config python3 -c 'print("["*100000 + "]"*100000)'
file_case refuse "100000 nested objects" --config python3 -c 'print("{\"a\":"*100000 + "1" + "}"*100000)'
file_case refuse "17 MiB of spaces" --config python3 -c 'print("{" + " "*(17<<20) + "}")'
file_case refuse "invalid UTF-8" --config printf '{"zero_optimization": {"stage": "\xff"}}'
file_case refuse "stage 2^63" --config printf '{"zero_optimization": {"stage": 9223372036854775808}}'
file_case refuse "gas 1e400" --config printf '{"gradient_accumulation_steps": 1e400}'
file_case refuse "gas -1" --config printf '{"gradient_accumulation_steps": -1}'
file_case refuse "duplicate key" --config printf '{"gradient_accumulation_steps": 1, "gradient_accumulation_steps": 2}'
file_case refuse "bucket 2^64" --config printf '{"zero_optimization": {"reduce_bucket_size": 18446744073709551616}}'
file_case either "gas 2^31-1 (exact or refused, never negative)" --config printf '{"gradient_accumulation_steps": 2147483647}'
file_case accept "prefetch INT64_MAX" --config printf '{"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 9223372036854775807}}'

model_case() {  # model_case EXPECT NAME JSON
  new_case
  printf '%s' "$3" >model.json
  run "$1" "plan --model <$2>" "${bin}" plan --model model.json
  done_case
}
big='{"name": "w", "shape": [1048576, 1048576, 8]}'
model_case refuse "sizes summing past 2^63" \
  "{\"modules\": [{\"name\": \"m\", \"params\": [$(for i in $(seq 1 1100); do printf '%s,' "${big}"; done)${big}]}]}"
model_case refuse "a 2^70-element parameter" \
  '{"modules": [{"name": "m", "params": [{"name": "w", "shape": [1073741824, 1073741824, 1024]}]}]}'
model_case refuse "unknown key" '{"modules": [{"name": "m", "params": [{"name": "w", "shap": [4]}]}]}'
model_case refuse "shape [0]" '{"modules": [{"name": "m", "params": [{"name": "w", "shape": [0]}]}]}'
model_case refuse "shape [-4]" '{"modules": [{"name": "m", "params": [{"name": "w", "shape": [-4]}]}]}'
model_case refuse "no modules" '{"modules": []}'
model_case refuse "shape 1e300" '{"modules": [{"name": "m", "params": [{"name": "w", "shape": [1e300]}]}]}'

new_case
mkfifo fifo.json
run refuse "plan --config <a FIFO nobody writes>" "${bin}" plan --params 1e9 --config fifo.json
done_case

# ---- ckpt ---------------------------------------------------------------------------------
ck_refuse() { new_case; run refuse "ckpt $*" "${bin}" ckpt "$@"; done_case; }
ck_refuse inspect no/such/dir
ck_refuse bogus ck
ck_refuse inspect
ck_refuse consolidate ck
ck_refuse inspect ck --wrong-flag
new_case; run accept "ckpt --help" "${bin}" ckpt --help; done_case
new_case; run accept "ckpt inspect ck --json" "${bin}" ckpt inspect ck --json; done_case

# Hostile manifests: edit step_2's manifest, then inspect and consolidate it.
manifest_case() {  # manifest_case NAME PYTHON [INSPECT-EXPECT (refuse)]
  local name="$1" code="$2" sub
  for sub in inspect consolidate; do
    new_case
    edit_manifest ck/step_2/manifest.json "${code}"
    if [[ ${sub} == inspect ]]; then
      run "${3:-refuse}" "ckpt inspect <${name}>" "${bin}" ckpt inspect ck
    else
      mkdir out
      run refuse "ckpt consolidate <${name}>" "${bin}" ckpt consolidate ck out/x.safetensors
      [[ -n "$(ls -A out)" && ${rc} -ne 0 ]] && worse data-loss  # a temporary left behind
    fi
    done_case
  done
}
manifest_case "2^36 elements per shard in 1 KB files" \
  'm["shard_elements"] = 1 << 36
for u in m["units"]: u["shard"] = 1 << 36; u["padded"] = (1 << 36) * m["world_size"]
for f in m["files"]: f["bytes"] = 1024'
manifest_case "shape [74696998, 987817158259] (product wraps)" \
  'm["params"][0]["shape"] = [74696998, 987817158259]'
manifest_case "shape with a negative dimension" 'm["params"][0]["shape"] = [-256, -128]'
manifest_case "a parameter named __metadata__" 'm["params"][0]["name"] = "__metadata__"' either
manifest_case "two parameters with one name" 'm["params"][1]["name"] = m["params"][0]["name"]'
manifest_case "a name with an escape sequence" 'm["params"][0]["name"] = "w\u001b[2J"'
manifest_case "a name that is not UTF-8" 'm["params"][0]["name"] = "w\udcff"'
manifest_case "world_size 2^40" 'm["world_size"] = 1 << 40'
manifest_case "world_size 0" 'm["world_size"] = 0'
manifest_case "a file outside the checkpoint" 'm["files"][0]["name"] = "../../../etc/passwd"'
manifest_case "the unit offset past the shard" 'm["params"][0]["offset_in_unit"] = 1 << 62'
manifest_case "format_version 99" 'm["format_version"] = 99'

# The same checks without the checksum recomputed, and the manifest as other file types.
raw_manifest_case() {  # raw_manifest_case NAME COMMAND
  new_case
  (cd ck/step_2 && rm -f manifest.json && eval "$2")
  run refuse "ckpt inspect <manifest: $1>" "${bin}" ckpt inspect ck
  done_case
}
raw_manifest_case "empty" ': >manifest.json'
raw_manifest_case "garbage" 'head -c 1000 /dev/urandom >manifest.json'
raw_manifest_case "17 MiB" 'head -c $((17 << 20)) /dev/zero | tr "\0" " " >manifest.json'
raw_manifest_case "a FIFO" 'mkfifo manifest.json'
raw_manifest_case "a symlink to /dev/zero" 'ln -s /dev/zero manifest.json'
raw_manifest_case "a directory" 'mkdir manifest.json'
raw_manifest_case "missing" ':'

# Shards: truncated, corrupted, a symlink (even to the right bytes), a directory.
shard_case() {
  new_case
  (cd ck/step_2 && eval "$2")
  run refuse "ckpt inspect <shard: $1>" "${bin}" ckpt inspect ck
  done_case
}
shard_case "truncated" 'truncate -s 1000 rank_00001.bin'
shard_case "one byte flipped" 'printf "\x55" | dd of=rank_00001.bin bs=1 seek=4096 conv=notrunc 2>/dev/null'
shard_case "longer" 'printf "x" >>rank_00001.bin'
shard_case "a symlink outside the checkpoint" 'mv rank_00001.bin ../../r1 && ln -s ../../r1 rank_00001.bin'
shard_case "a directory" 'rm rank_00001.bin && mkdir rank_00001.bin'

# `latest`: a symlink to a secret, escape codes, huge, traversal, a symlinked step directory.
latest_case() {  # latest_case NAME COMMAND [MUST-NOT-PRINT]
  new_case
  echo "SECRET-LINE-42" >secret
  (cd ck && rm -f latest && eval "$2")
  run refuse "ckpt inspect <latest: $1>" "${bin}" ckpt inspect ck
  if grep -q "SECRET-LINE-42" <<<"${out}" || [[ "${out}" == *$'\033'* ]]; then worse wrong; fi
  done_case
}
latest_case "a symlink to a secret file" 'ln -s ../secret latest'
latest_case "escape codes" 'printf "step_2\033]0;pwned\007\033[2J" >latest'
latest_case "5000 bytes" 'head -c 5000 /dev/zero | tr "\0" "A" >latest'
latest_case "step_-1" 'printf step_-1 >latest'
latest_case "a path out of the root" 'printf "step_2/../../secret" >latest'
latest_case "a symlinked step directory" 'ln -s step_2 step_7 && printf step_7 >latest'
latest_case "a FIFO" 'mkfifo latest'
latest_case "an absolute path" 'printf "/etc" >latest'

# The checkpoint path itself not UTF-8 (printed as JSON: must stay valid JSON, no crash).
new_case
mv ck "$(printf 'dir\xff')"
run accept "ckpt inspect <a path that is not UTF-8> --json" "${bin}" ckpt inspect "$(printf 'dir\xff')" --json
if [[ ${rc} -eq 0 ]] && ! python3 -c 'import json,sys; json.loads(sys.stdin.buffer.read())' <<<"${out}" \
    2>/dev/null; then worse wrong; fi
done_case

# ---- consolidate: nothing lost or overwritten, no temporary left ----------------------------
protect_case() {  # protect_case EXPECT NAME OUT [SETUP]: ck and every victim/ file survive
  new_case
  mkdir victim && echo keep >victim/x && ln -s x victim/link && echo keep >victim/target &&
    ln -s target victim/out.tmp
  local before after
  before=$(sums ck victim/x victim/target)
  run "$1" "ckpt consolidate ck $3 <$2>" "${bin}" ckpt consolidate ck "$3"
  after=$(sums ck victim/x victim/target)
  [[ "${before}" == "${after}" && -L victim/link && -L victim/out.tmp ]] || worse data-loss
  done_case
}
protect_case refuse "a shard of the checkpoint read" ck/step_2/rank_00000.bin
protect_case refuse "its manifest" ck/step_2/manifest.json
protect_case refuse "its latest" ck/latest
protect_case refuse "a new file in its step directory" ck/step_2/new.safetensors
protect_case refuse "a new file in its root" ck/new.safetensors
protect_case refuse "an existing file" victim/x
protect_case refuse "a symlink to an existing file" victim/link
protect_case accept "beside a planted OUT.tmp symlink" victim/out
protect_case refuse "a directory" victim

leftover_case() {  # leftover_case NAME OUT [SETUP] [WRAPPER]: refused, and nothing new remains
  new_case
  mkdir -p outd
  eval "${3:-:}"
  local before after
  before=$(ls -A outd)
  if [[ -n "${4:-}" ]]; then  # a file-size limit, as on a full disk (SIGXFSZ ignored)
    run refuse "ckpt consolidate ck $2 <$1>" bash -c 'trap "" XFSZ; ulimit -f 64; exec "$@"' _ \
      "${bin}" ckpt consolidate ck "$2"
  else
    run refuse "ckpt consolidate ck $2 <$1>" "${bin}" ckpt consolidate ck "$2"
  fi
  after=$(ls -A outd)
  [[ "${before}" == "${after}" ]] || worse data-loss
  done_case
}
leftover_case "empty OUT" ''
leftover_case "OUT a directory name" outd/
leftover_case "OUT in a missing directory" outd/no/such/x
leftover_case "a disk full (file size limit 64 KiB)" outd/x '' fsize

# Two consolidates racing for one OUT: one wins, the other refuses, the file is complete.
new_case
mkdir outd
tried=$((tried + 1))
case_name="two consolidates racing for one OUT"
timeout 60 "${bin}" ckpt consolidate ck outd/x >a.log 2>&1 &
pa=$!
timeout 60 "${bin}" ckpt consolidate ck outd/x >b.log 2>&1 &
pb=$!
wait ${pa}; ra=$?
wait ${pb}; rb=$?
rc="${ra}/${rb}"
out=$(cat a.log b.log)
"${maker}" ckpt consolidate ck ref >/dev/null 2>&1
if [[ ${ra} -ge 124 || ${rb} -ge 124 ]]; then
  verdict=crash; [[ ${ra} -eq 124 || ${rb} -eq 124 ]] && verdict=hang
elif [[ $(ls -A outd) != x ]] || ! cmp -s outd/x ref; then
  verdict=data-loss
elif [[ $((ra == 0)) -eq $((rb == 0)) ]]; then
  verdict=wrong  # both won (one silently overwrote the other) or both failed
else
  verdict=refused
fi
done_case

# A consolidate to a fresh OUT works and leaves only OUT (the control).
new_case
mkdir outd
run accept "ckpt consolidate ck outd/x (valid)" "${bin}" ckpt consolidate ck outd/x
[[ $(ls -A outd) == x ]] || worse data-loss
done_case

# ---- bootstrap: in-process ranks of `zerort demo` ----------------------------------------
for v in 0 -1 2e9 4294967297 100000 abc; do
  new_case
  run refuse "demo --ranks ${v}" "${bin}" demo --ranks "${v}" --steps 1
  done_case
done
for args in "--steps -1" "--steps 1e300" "--stage 9" "--model nosuch" "--resume no/such/dir" \
            "--checkpoint_every 0 --checkpoint c --steps 1"; do
  new_case
  # shellcheck disable=SC2086
  run refuse "demo ${args}" "${bin}" demo ${args}
  done_case
done

clean=$((count[refused] + count[accepted]))
echo "hardening_cases: ${bin}"
echo "  tried ${tried}: refused cleanly ${count[refused]}, accepted correctly ${count[accepted]}," \
  "crash ${count[crash]}, hang ${count[hang]}, wrong ${count[wrong]}," \
  "data loss ${count[data-loss]} (clean ${clean} of ${tried})"
[[ ${clean} -eq ${tried} ]]
