"""Hybrid data/model parallelism over MPI: which layer runs how (plan), the collectives (comm),
sharded InnerProduct (model_parallel) and gradient reduction (data_parallel).

Starting and ending a job reads top-down: launch.py (the `--np` launcher: mpiexec and the ranks
seen from outside) and comm.py (the communicators and their watchdog, inside each rank) both
build on ranks.py (the job folder the ranks write for the launcher, and ending the whole job
from one rank), which imports neither."""
