#!/usr/bin/env bash
# Starts (or finds running) a one-node Slurm cluster on this machine for tests/launch: slurmctld
# and slurmd from Debian's slurm-wlm, started by hand with a configuration in $ZERORT_SLURM_DIR
# (default /tmp/zerort-slurm), on ports 16817/16818, authentication auth/none (no munge daemon:
# everything runs as root on one host). Prints the path of slurm.conf (export it as SLURM_CONF)
# and exits 0 once `sinfo` shows the node idle; exits 1 with the reason otherwise.
# Usage: tests/launch/slurm_cluster.sh [start|stop]
set -uo pipefail
dir=${ZERORT_SLURM_DIR:-/tmp/zerort-slurm}
conf=$dir/slurm.conf
node=$(hostname -s)
if [ "${1:-start}" = stop ]; then
  for d in slurmd slurmctld; do
    [ -f "$dir/$d.pid" ] && kill "$(cat "$dir/$d.pid")" 2>/dev/null
  done
  exit 0
fi
die() {
  echo "slurm_cluster: $1" >&2
  exit 1
}
for tool in slurmctld slurmd srun sinfo; do
  command -v "$tool" >/dev/null || die "$tool not installed (slurm-wlm)"
done
# srun's tasks find rank 0 by this name (the node list's first host), as on a real cluster.
getent hosts "$node" >/dev/null || die "host name $node does not resolve (add it to /etc/hosts)"
export SLURM_CONF=$conf
if [ -f "$dir/slurmctld.pid" ] && kill -0 "$(cat "$dir/slurmctld.pid")" 2>/dev/null &&
   [ -f "$dir/slurmd.pid" ] && kill -0 "$(cat "$dir/slurmd.pid")" 2>/dev/null &&
   sinfo -h -o %t 2>/dev/null | grep -qE '^(idle|mix|alloc)'; then
  echo "$conf"
  exit 0
fi
mkdir -p "$dir/state" "$dir/spool"
cpus=$(nproc)
cat >"$conf" <<CONF
ClusterName=zerort
SlurmctldHost=$node(127.0.0.1)
SlurmctldPort=16817
SlurmdPort=16818
AuthType=auth/none
CredType=cred/none
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd.log
ProctrackType=proctrack/pgid
TaskPlugin=task/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
ReturnToService=2
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
NodeName=$node NodeAddr=127.0.0.1 CPUs=$cpus State=UNKNOWN
PartitionName=debug Nodes=$node Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
CONF
last() { tail -3 "$1" 2>/dev/null | tr '\n' ' '; }
slurmctld -c -f "$conf" || die "slurmctld failed to start: $(last "$dir/slurmctld.log")"
slurmd -f "$conf" || die "slurmd failed to start: $(last "$dir/slurmd.log")"
for _ in $(seq 1 100); do
  if sinfo -h -o %t 2>/dev/null | grep -qE '^(idle|mix|alloc)'; then
    echo "$conf"
    exit 0
  fi
  sleep 0.2
done
die "node not idle after 20 s: $(sinfo 2>&1 | tail -2 | tr '\n' ' ') slurmctld: \
$(last "$dir/slurmctld.log") slurmd: $(last "$dir/slurmd.log")"
