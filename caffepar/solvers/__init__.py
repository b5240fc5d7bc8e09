"""Caffe's solvers: learning-rate policies, update rules, the training loop, snapshots."""
from caffepar.solvers.lr_policy import POLICIES, learning_rate
from caffepar.solvers.rules import RULES
from caffepar.solvers.solver import (SOLVERS, AdaDeltaSolver, AdaGradSolver, AdamSolver,
                                     NesterovSolver, RMSPropSolver, SGDSolver, Solver,
                                     get_solver, load_solver_param, upgrade_solver_param)

__all__ = ["Solver", "SGDSolver", "NesterovSolver", "AdaGradSolver", "RMSPropSolver",
           "AdaDeltaSolver", "AdamSolver", "SOLVERS", "RULES", "POLICIES", "get_solver",
           "learning_rate", "load_solver_param", "upgrade_solver_param"]
