"""Hybrid data/model parallelism over MPI: which layer runs how (plan), the collectives (comm),
sharded InnerProduct (model_parallel) and gradient reduction (data_parallel)."""
