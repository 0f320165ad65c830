#!/usr/bin/env bash
# Install Slurm and munge (Debian packages) so tests/test_slurm.py can start a real one-node
# cluster with scripts/slurm/local_cluster.sh. Does nothing when they are already there.
set -euo pipefail

# The daemons live in /usr/sbin, which a non-root PATH may lack.
have_all() {
  local cmd
  for cmd in sbatch srun scontrol sinfo slurmctld slurmd munged; do
    PATH=$PATH:/usr/sbin:/sbin command -v "$cmd" >/dev/null 2>&1 || return 1
  done
}

if have_all; then
  echo "setup_slurm: Slurm and munge already installed ($(command -v sbatch))"
  exit 0
fi

source "$(dirname "$0")/apt_install.sh"

# slurm-wlm pulls slurmctld, slurmd and the client tools; munge authenticates them to each other.
# Post-install scripts may try to start the system services: without systemd (containers) that
# fails harmlessly, and local_cluster.sh starts its own daemons with its own config anyway.
apt_install slurm-wlm munge

have_all || { echo "setup_slurm: Slurm commands still missing after apt-get install" >&2; exit 1; }
# (sbatch --version would need a slurm.conf: ask dpkg instead.)
echo "setup_slurm: installed slurm-wlm $(dpkg-query -W -f='${Version}' slurm-wlm)"
