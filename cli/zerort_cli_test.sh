#!/usr/bin/env bash
# Runs the zerort binary on hostile `plan` input: every case must be refused cleanly (exit 2, one
# "zerort plan: ..." line naming the problem), never crash (exit >= 128), hang (20 s) or print a
# negative size. Also: `zerort CMD --help` prints that command's usage and exits 0.
set -uo pipefail
zerort=$1
tmp=${TEST_TMPDIR:-$(mktemp -d)}
tried=0 refused=0 crashes=0 hangs=0 failures=0

# expect_refusal NEEDLE ARGS...: exit 2 and NEEDLE in the error.
expect_refusal() {
  local needle=$1
  shift
  tried=$((tried + 1))
  local err rc
  err=$(timeout 20 "$zerort" plan "$@" 2>&1 >/dev/null)
  rc=$?
  if [ "$rc" -eq 124 ]; then
    hangs=$((hangs + 1)); echo "HANG: plan $*"
  elif [ "$rc" -ge 128 ]; then
    crashes=$((crashes + 1)); echo "CRASH ($rc): plan $*: $err"
  elif [ "$rc" -ne 2 ] || [[ "$err" != *"$needle"* ]]; then
    failures=$((failures + 1)); echo "NOT REFUSED AS EXPECTED (exit $rc): plan $*: $err"
  else
    refused=$((refused + 1))
  fi
}

printf '{"bf16": {"enabled": true}}\0{"fp16": {"enabled": true}}' >"$tmp/nul.json"
echo '{"gradient_accumulation_steps": 2147483647}' >"$tmp/gas.json"
echo '{"modules": [{"name": "l", "params": [{"name": "w", "shap": [3]}]}]}' >"$tmp/typo.json"
python3 -c '
import json, sys
m = [{"name": "m%d" % i, "params": [{"name": "w", "shape": [2**50]}]} for i in range(8193)]
json.dump({"modules": m}, open(sys.argv[1], "w"))' "$tmp/huge.json"

expect_refusal "must be an integer in 1..4096" --params 2e9 --layers 2e9
expect_refusal 'config file "/dev/zero": not a regular file' --model gpt2-124m --config /dev/zero
expect_refusal 'not a regular file' --model /dev/zero
expect_refusal "the plan's" --params 1e18 --layers 1000
expect_refusal "exceeds 2^63-1" --params 1e18 --layers 1000 --stage auto --budget 1GiB
expect_refusal "parameter count exceeds 2^63-1" --model "$tmp/huge.json"
expect_refusal "communication bytes per step exceeds" --params 1e12 --world 8 --config "$tmp/gas.json"
expect_refusal "must be an integer in 1..2147483647" --params 1000 --world 4294967297
expect_refusal "flag '--params'" --params 9223372036854775808
expect_refusal "flag '--params'" --params nan
expect_refusal "cannot read part 'device=1GiB=junk'" --params 1000 --budget device=1GiB=junk
expect_refusal "'device' is given twice" --params 1000 --budget device=1GiB,device=2GiB
expect_refusal "a NUL byte" --params 1000 --config "$tmp/nul.json"
expect_refusal 'did you mean "shape"?' --model "$tmp/typo.json"
expect_refusal "unknown flag '--wrld'" --params 1000 --wrld 8

for command in plan demo ckpt; do
  tried=$((tried + 1))
  out=$(timeout 20 "$zerort" "$command" --some-flag --help 2>&1)
  rc=$?
  if [ "$rc" -eq 0 ] && [[ "$out" == "usage: zerort $command"* ]]; then
    refused=$((refused + 1))
  else
    failures=$((failures + 1)); echo "HELP FAILED (exit $rc): $command --help: $out"
  fi
done

echo "bad inputs tried: $tried, handled as expected: $refused, crashes: $crashes, hangs: $hangs," \
  "other failures: $failures"
[ $((crashes + hangs + failures)) -eq 0 ]
