#!/usr/bin/env bash
# The cluster group of the tests (tests/test_cluster_engines.py, marked `cluster`): Slurm and
# Open MPI on the network lab, a few minutes. Installs what it needs where it is missing (Debian's
# slurm-wlm, munge, openmpi-bin and libopenmpi-dev; the venv whose mpi4py is built against Open
# MPI), then runs the group. Needs root (the lab's namespaces, Slurm's daemons).
#     bash scripts/cluster_tests.sh [pytest options]
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$PATH:/usr/sbin:/sbin"
missing=()
for prog in slurmctld slurmd sbatch munged mpirun mpicc; do
    command -v "$prog" >/dev/null || missing+=("$prog")
done
if ((${#missing[@]})); then
    echo "cluster tests: installing Slurm, munge and Open MPI (${missing[*]} missing)"
    if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
        echo "cluster tests: need root and apt-get to install slurm-wlm munge openmpi-bin" \
             "libopenmpi-dev; install them and run again" >&2
        exit 1
    fi
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq -o DPkg::Lock::Timeout=600 \
        slurm-wlm munge openmpi-bin libopenmpi-dev >/dev/null
fi
make --no-print-directory .venv/.installed .venv-openmpi/.installed
exec .venv/bin/python -m pytest -q -p no:cacheprovider -m cluster tests/test_cluster_engines.py "$@"
