"""Run under mpiexec: the tests' small SSD (AnnotatedData with augmentations, BatchNorm,
MultiBoxLoss) for ITERATIONS at batch B per rank in DATA mode; rank 0 writes the losses and the
final snapshot into FOLDER."""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ssd_nets import ssd_solver_param  # noqa: E402

from caffepar.parallel.comm import MpiComm  # noqa: E402
from caffepar.parallel.data_parallel import make_parallel_solver  # noqa: E402
from caffepar.parallel.plan import Planner  # noqa: E402


def main():
    folder, batch, iterations = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    comm = MpiComm()
    param = ssd_solver_param(folder, batch, iterations, folder / f"p{comm.size}")
    solver = make_parallel_solver(param, comm, planner=Planner("data", (), None))
    solver.solve()
    if comm.rank == 0:
        losses = [row["loss"] for row in solver.history_rows if "lr" in row]
        (folder / f"losses_p{comm.size}.json").write_text(json.dumps(losses))


if __name__ == "__main__":
    main()
