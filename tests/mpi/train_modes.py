"""Run under mpiexec: train every net of nets.py in every parallel mode at batch M per rank;
rank 0 writes the per-iteration losses and the final snapshot of each run into FOLDER.
Also resumes a one-process snapshot (RESUME_FROM) at this P when given."""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from nets import MODES, NETS, solver_param  # noqa: E402

from caffepar.parallel.comm import MpiComm  # noqa: E402
from caffepar.parallel.data_parallel import make_parallel_solver  # noqa: E402
from caffepar.parallel.plan import DEFAULT_THRESHOLD, Planner  # noqa: E402


def planner(mode):
    default, forced, threshold, _ = MODES[mode]
    return Planner(default, forced, DEFAULT_THRESHOLD if threshold is None else threshold)


def main():
    folder, batch = Path(sys.argv[1]), int(sys.argv[2])
    resume = sys.argv[3:]
    comm = MpiComm()
    results = {}
    runs = [(n, m) for n in NETS for m in MODES] if not resume else []
    for name, mode in runs:
        prefix = folder / f"p{comm.size}_{name}_{mode}"
        param = solver_param(folder, name, batch, mode, prefix, snapshot=10)
        solver = make_parallel_solver(param, comm, planner=planner(mode))
        solver.solve()
        results[f"{name}/{mode}"] = [row["loss"] for row in solver.history_rows if "lr" in row]
    for spec in resume:
        name, mode, state = spec.split(":", 2)
        prefix = folder / f"p{comm.size}_{name}_{mode}_resumed"
        param = solver_param(folder, name, batch, mode, prefix)
        solver = make_parallel_solver(param, comm, planner=planner(mode))
        solver.solve(resume_file=state)
        results[f"{name}/{mode}/resumed"] = [row["loss"] for row in solver.history_rows
                                             if "lr" in row]
    if comm.rank == 0:
        out = folder / (f"losses_p{comm.size}.json" if not resume else f"resumed_p{comm.size}.json")
        out.write_text(json.dumps(results))


if __name__ == "__main__":
    main()
