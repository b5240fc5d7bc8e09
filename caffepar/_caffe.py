"""pycaffe's compiled module `caffe._caffe`, by its names: the classes scripts test types
against (`type(net.params[name]) is caffe._caffe.BlobVec`) and the functions pycaffe's
__init__ takes from it."""
from caffepar import __version__
from caffepar.blob import Blob, BlobVec
from caffepar.pycaffe import (NCCL, Layer, Net, Timer, get_solver, has_nccl, init_log,
                              layer_type_list, log, set_device, set_mode_cpu, set_mode_gpu,
                              set_multiprocess, set_random_seed, set_solver_count,
                              set_solver_rank, solver_count, solver_rank)
from caffepar.solvers import (AdaDeltaSolver, AdaGradSolver, AdamSolver, NesterovSolver,
                              RMSPropSolver, SGDSolver, Solver)

__all__ = ["Net", "Blob", "BlobVec", "Layer", "Solver", "SGDSolver", "NesterovSolver",
           "AdaGradSolver", "RMSPropSolver", "AdaDeltaSolver", "AdamSolver", "get_solver",
           "NCCL", "Timer", "init_log", "log", "has_nccl", "set_mode_cpu", "set_mode_gpu",
           "set_device", "set_random_seed", "solver_count", "set_solver_count", "solver_rank",
           "set_solver_rank", "set_multiprocess", "layer_type_list", "__version__"]
