# Sourced by tests/launch/*_test.sh: checks launch_check's output lines.
# check_ranks FILE WORLD SOURCE STORE [DEVICE]: one line per rank 0..WORLD-1, each with
# world=WORLD, source=SOURCE, store=STORE, local_rank == rank and local_world == WORLD (one
# node), device=DEVICE (default: the local rank), and the same payload on every rank: two
# distinct exchanges, both made by the same rank 0 process.
check_ranks() {
  local file=$1 world=$2 source=$3 store=$4 device=${5:-} r line payload first=""
  if [ "$(grep -c '^launch_check ' "$file")" -ne "$world" ]; then
    echo "FAIL: expected $world launch_check lines:"; cat "$file"; return 1
  fi
  for ((r = 0; r < world; r++)); do
    line=$(grep "^launch_check rank=$r " "$file")
    local want="launch_check rank=$r world=$world local_rank=$r local_world=$world"
    want+=" device=${device:-$r} source=$source store=$store payload="
    if [ "${line%%payload=*}payload=" != "$want" ]; then
      echo "FAIL: rank $r printed"; echo "  $line"; echo "expected"; echo "  $want..."; return 1
    fi
    payload=${line#*payload=}
    if ! [[ $payload =~ ^pid([0-9]+)-call0,pid([0-9]+)-call1$ ]] ||
       [ "${BASH_REMATCH[1]}" != "${BASH_REMATCH[2]}" ]; then
      echo "FAIL: rank $r payload '$payload' is not rank 0's two exchanges"; return 1
    fi
    [ -z "$first" ] && first=$payload
    if [ "$payload" != "$first" ]; then
      echo "FAIL: rank $r got '$payload', rank 0 '$first'"; return 1
    fi
  done
  echo "ok: $world ranks, source=$source store=$store, payload $first on every rank"
}
