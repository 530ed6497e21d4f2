#!/usr/bin/env bash
# Install what tests/test_slurm_real.py needs for a real (one-machine) SLURM: Debian's slurmctld, slurmd,
# slurm-client and munge. Optional: without them (or without root) that test is skipped with its reason.
# .ci/run calls this first; it never fails the build, it says what it did.
set -uo pipefail
if command -v slurmctld >/dev/null 2>&1 || [ -x /usr/sbin/slurmctld ]; then
  echo "install-slurm: already installed"
  exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "install-slurm: needs root and apt-get; tests/test_slurm_real.py will be skipped"
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
if apt-get install -y -q slurmctld slurmd slurm-client munge >/tmp/install-slurm.log 2>&1 \
  || { apt-get update -q >>/tmp/install-slurm.log 2>&1 \
       && apt-get install -y -q slurmctld slurmd slurm-client munge >>/tmp/install-slurm.log 2>&1; }; then
  echo "install-slurm: installed slurmctld, slurmd, slurm-client, munge"
else
  echo "install-slurm: apt-get failed (see /tmp/install-slurm.log); tests/test_slurm_real.py will be skipped"
fi
exit 0
