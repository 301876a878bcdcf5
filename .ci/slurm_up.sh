#!/usr/bin/env bash
# Stands up a one-node SLURM cluster on this machine, for tests/test_slurm.py.
#
# Idempotent: run it again and it checks what is there, starts what is missing and waits for
# the node. Root only (it installs Debian's slurm-wlm and munge, writes /etc/slurm/slurm.conf
# and starts munged, slurmctld and slurmd). The cluster: this host as controller and only
# node, with all its CPUs, one partition "ci" that oversubscribes them (several test jobs on
# 2 cores), process tracking without cgroups, spool, state and logs under $ZEROJAX_SLURM_DIR
# (default /tmp/zerojax-slurm). It leaves the daemons running; the tests submit to them.
set -euo pipefail

DIR=${ZEROJAX_SLURM_DIR:-/tmp/zerojax-slurm}
CONF=/etc/slurm/slurm.conf
MARK="# written by zerojax .ci/slurm_up.sh"
HOST=$(hostname)

fail() {
  echo ".ci/slurm_up.sh: $*" >&2
  exit 1
}

[ "$(id -u)" -eq 0 ] || fail "must run as root: it installs packages, writes $CONF and starts
  daemons. Run it as root (sudo $0), or skip the SLURM tests (they skip when sinfo is missing)."

if ! command -v slurmctld > /dev/null || ! command -v munged > /dev/null; then
  command -v apt-get > /dev/null || fail "SLURM is not installed and there is no apt-get to
  install Debian's slurm-wlm and munge: install SLURM (slurmctld, slurmd, srun, sbatch) and
  munge yourself, then run this again."
  echo ".ci/slurm_up.sh: installing slurm-wlm and munge"
  export DEBIAN_FRONTEND=noninteractive
  mkdir -p "$DIR"
  if ! { apt-get update -q && apt-get install -y -q slurm-wlm munge; } > "$DIR/apt.log" 2>&1; then
    tail -n 20 "$DIR/apt.log" >&2
    fail "apt-get could not install slurm-wlm and munge (its last lines are above)"
  fi
fi

# (Before .ci/ held it, this script lived in ci/: a configuration it wrote there is its own too.)
if [ -e "$CONF" ] && ! grep -qF "# written by zerojax " "$CONF"; then
  fail "$CONF exists and was not written by this script: this machine has its own SLURM
  configuration, which this script leaves alone. Use that cluster, or move $CONF away."
fi

# Whether the daemon of this pid file runs.
running() { [ -s "$1" ] && kill -0 "$(cat "$1" 2> /dev/null)" 2> /dev/null; }

mkdir -p "$DIR"/{state,spool,log} /run/munge /etc/slurm
chown munge:munge /run/munge
cat > "$DIR/slurm.conf" << EOF
$MARK
ClusterName=zerojax
SlurmctldHost=$HOST
SlurmUser=root
AuthType=auth/munge
# A requeued job may start again this many seconds later (the lifetime of the credentials of its
# previous run, which the node revokes): 120 by default, which a test would wait for.
AuthInfo=cred_expire=5
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
# Look for jobs to start every 1-2 s (60 by default): a requeued job becomes startable by itself,
# some seconds after it is requeued, and nothing else would look for it.
SchedulerParameters=bf_interval=1,sched_interval=2
SelectTypeParameters=CR_CPU
ReturnToService=2
# A cancelled or requeued job's tasks get SIGTERM, then SIGKILL this many seconds later.
KillWait=10
# Finished jobs are forgotten after 5 s (default 300), which makes sbatch --wait check every
# 2 s instead of backing off to 32 s (it keeps its polls below half of this).
MinJobAge=5
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
NodeName=$HOST CPUs=$(nproc) State=UNKNOWN
PartitionName=ci Nodes=$HOST Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE
EOF
if ! cmp -s "$DIR/slurm.conf" "$CONF"; then
  cp "$DIR/slurm.conf" "$CONF"
  # A controller or node daemon of an older configuration must read the new one.
  for daemon in slurmctld slurmd; do
    if running "$DIR/$daemon.pid"; then
      pid=$(cat "$DIR/$daemon.pid")
      kill "$pid"
      while kill -0 "$pid" 2> /dev/null; do sleep 0.2; done
    fi
  done
fi

running /run/munge/munged.pid || munged --force --log-file="$DIR/log/munged.log"
running "$DIR/slurmctld.pid" || slurmctld
running "$DIR/slurmd.pid" || slurmd

for _ in $(seq 120); do
  state=$(sinfo --noheader --nodes="$HOST" --format=%T 2> /dev/null || true)
  if [ "$state" = idle ] || [ "$state" = mixed ] || [ "$state" = allocated ]; then
    echo ".ci/slurm_up.sh: node $HOST is $state: $(sinfo --noheader --format='%P %D %c %T')"
    exit 0
  fi
  # A node left down or drained by an earlier run (a daemon killed with the machine) comes back.
  case "$state" in down | drain*) scontrol update NodeName="$HOST" State=RESUME || true ;; esac
  sleep 0.5
done
tail -n 20 "$DIR"/log/*.log >&2 || true
fail "node $HOST is not idle after 60 s (sinfo says: '${state:-nothing}'); the logs are above"
