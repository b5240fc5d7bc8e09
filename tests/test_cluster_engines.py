"""The cluster engines users have, on the network lab: Slurm (sbatch, salloc + srun, scancel, a
node lost) and Open MPI (mpi4py built against it, run by its mpirun). Each trains the same job
as hydra and the mpich wheel and must reach the same weights.

The tests that start Slurm or Open MPI form the `cluster` group (a few minutes): they run with
`-m cluster` or CAFFEPAR_CLUSTER_TESTS=1 (scripts/cluster_tests.sh installs what they need and
runs them), and skip, saying what is missing, where Slurm, Open MPI, its mpi4py or root is not
there. The rest (configuration, environment, MPI naming) run everywhere."""
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from caffepar import netlab, netlab_slurm
from caffepar.parallel import mpilib

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE / "mpi"))

#: The Python of the venv whose mpi4py is built against Open MPI (make .venv-openmpi/.installed).
OPENMPI_PYTHON = Path(os.environ.get("CAFFEPAR_OPENMPI_PYTHON")
                      or ROOT / ".venv-openmpi" / "bin" / "python")
#: Every run of one job computes alike: the convolution engines of the fixed rules, and the
#: NumPy kernels (no rank waits for the compiled ones to be built: these tests are of MPI).
JOB_ENV = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "CAFFEPAR_KERNELS": "numpy",
           "CAFFEPAR_CONV_ENGINES": "rules", "CAFFEPAR_CONTENDED": "0"}


def _openmpi_missing():
    if shutil.which("mpirun") is None or not mpilib.is_open_mpi_launcher(shutil.which("mpirun")):
        return "no Open MPI mpirun (apt-get install openmpi-bin libopenmpi-dev)"
    if not OPENMPI_PYTHON.exists():
        return "no venv with mpi4py built against Open MPI (make .venv-openmpi/.installed)"
    return None


need_lab = pytest.mark.skipif(netlab.missing_privileges() is not None,
                              reason=f"cannot build a lab here: {netlab.missing_privileges()}")
need_slurm = pytest.mark.skipif(netlab_slurm.missing_programs() is not None,
                                reason=netlab_slurm.missing_programs() or "")
need_openmpi = pytest.mark.skipif(_openmpi_missing() is not None, reason=_openmpi_missing() or "")
cluster = pytest.mark.cluster


def lab_name(tag):
    return f"s{os.getpid() % 100000}{tag}"


def weights(path):
    from caffepar.io.weights import read_caffemodel
    return {(n, i): v for n, _t, blobs in read_caffemodel(path).layers
            for i, (v, _s, _l) in enumerate(blobs)}


def assert_same_weights(a, b, rtol=1e-6):
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys() and wa
    for key in wa:
        np.testing.assert_allclose(wa[key], wb[key], rtol=rtol, atol=0, err_msg=str(key))


# ------------------------------------------------------------------------------ jobs
def cifar_job(folder, iterations=10):
    """cifar10_quick (tests/mpi/nets.py) on random images, batch 4 per rank."""
    from google.protobuf import text_format
    from nets import solver_param, write_data
    folder.mkdir(parents=True, exist_ok=True)
    write_data(folder, "cifar10_quick", 64)
    param = solver_param(folder, "cifar10_quick", 4, "data", folder / "snap/c",
                         max_iter=iterations)
    net = param.net_param
    param.ClearField("net_param")
    (folder / "net.prototxt").write_text(text_format.MessageToString(net))
    param.net = "net.prototxt"
    param.snapshot_prefix = "snap/c"
    param.display = 1
    (folder / "solver.prototxt").write_text(text_format.MessageToString(param))
    (folder / "snap").mkdir(exist_ok=True)
    return folder


def final(folder, iterations=10):
    return folder / f"snap/c_iter_{iterations}.caffemodel"


def tiny_job(folder, **kw):
    """test_jobs' tiny net, each forward sleeping 20 ms, with a fault layer (tests/mpi)."""
    from test_jobs import workdir
    folder.mkdir(parents=True, exist_ok=True)
    return workdir(folder, sleep=0.02, **kw)


def env_with(**extra):
    path = os.pathsep.join(filter(None, [str(HERE / "mpi"), os.environ.get("PYTHONPATH")]))
    return dict(os.environ, PYTHONPATH=path, **JOB_ENV, **extra)


def train_cmd(python, *args):
    return [str(python), "-m", "caffepar.cli", "train", "--solver", "solver.prototxt",
            *map(str, args)]


def hydra_run(lab, folder, ranks_per_node, *args):
    """The job on the lab through `caffepar netlab run`'s launcher (hydra, mpich wheel)."""
    argv = ["train", "--solver", "solver.prototxt", *map(str, args)]
    code = ("import sys\nfrom caffepar import netlab\n"
            f"lab = netlab.Lab({lab.name!r}, {lab.rates!r}, {ranks_per_node})\n"
            f"sys.exit(netlab.run_job(lab, {argv!r}))")
    done = subprocess.run([sys.executable, "-c", code], cwd=folder, env=env_with(),
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    return done.stdout + done.stderr


# ------------------------------------------------------------ without Slurm or Open MPI
def test_slurm_conf_per_node_paths_and_no_cgroups(tmp_path, monkeypatch):
    monkeypatch.setenv(netlab.STATE_DIR_VAR, str(tmp_path))
    lab = netlab.Lab("sc", netlab.parse_links("1gbit", 3), 2)
    conf = Path(netlab_slurm.write_conf(lab)).read_text()
    for line in ("ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
                 "SlurmctldHost=hub(198.18.0.1)", "NodeName=node2 NodeAddr=198.18.0.12 CPUs=2",
                 f"AuthInfo=socket={tmp_path}/sc/slurm/munge/munge.socket"):
        assert line in conf, line
    for key in ("SlurmdSpoolDir", "SlurmdPidFile", "SlurmdLogFile"):
        assert re.search(rf"^{key}={re.escape(str(tmp_path))}/sc/slurm/nodes/%n/", conf, re.M)
    assert "cgroup" not in conf
    assert (tmp_path / "sc/slurm/mpi.conf").read_text() == "PMIxCliTmpDirBase=/var/tmp\n"
    script = netlab_slurm.batch_script(["caffepar", "train", "--solver", "s p.prototxt"],
                                       {"A": "1"})
    assert "srun --mpi=pmi2 --kill-on-bad-exit=1 caffepar train --solver 's p.prototxt'" in script
    assert "#SBATCH --no-requeue" in script and "export A=1" in script


def test_mpich_under_slurm_pmi_takes_ofi():
    """Under srun's pmi2 (not hydra's PMI) MPICH is set to its OFI netmod, unless the user
    chose one; elsewhere nothing changes."""
    slurm = {"SLURM_MPI_TYPE": "pmi2", "PMI_FD": "11", "SLURM_STEP_ID": "0"}
    env = dict(slurm)
    assert mpilib.prepare_environment(env) == {"MPIR_CVAR_CH4_NETMOD": "ofi"}
    assert env["MPIR_CVAR_CH4_NETMOD"] == "ofi"
    chosen = dict(slurm, MPIR_CVAR_CH4_NETMOD="ucx")
    assert mpilib.prepare_environment(chosen) == {} and chosen["MPIR_CVAR_CH4_NETMOD"] == "ucx"
    for other in ({"PMI_FD": "9", "MPI_LOCALNRANKS": "1", **slurm},       # hydra in an allocation
                  {"PMI_FD": "9"}, {"SLURM_MPI_TYPE": "pmix", "SLURM_STEP_ID": "0"}):
        assert mpilib.prepare_environment(dict(other)) == {}


def test_version_names_the_mpi_library():
    done = subprocess.run([sys.executable, "-m", "caffepar.cli", "--version"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("caffepar, version ")
    from mpi4py import MPI
    first = " ".join(MPI.Get_library_version().splitlines()[0].split())
    assert lines[1].startswith(f"MPI: {first} (MPI "), lines
    if not _openmpi_missing():
        other = subprocess.run([str(OPENMPI_PYTHON), "-m", "caffepar.cli", "--version"],
                               capture_output=True, text=True, timeout=60)
        assert re.match(r"MPI: Open MPI v4\.1", other.stdout.splitlines()[1]), other.stdout


def test_launcher_of_another_mpi_refused(monkeypatch):
    """An mpi4py on MPICH started by Open MPI's mpirun (or the other way round) would run P
    one-rank jobs: refused in one line naming both."""
    monkeypatch.setattr(mpilib, "library_version", lambda: "MPICH Version: 5.0.2")
    monkeypatch.setattr(mpilib, "is_open_mpi_launcher", lambda exe: True)
    line = mpilib.check_launcher("/usr/bin/mpirun")
    assert "Open MPI's mpirun" in line and "MPICH Version: 5.0.2" in line
    monkeypatch.setattr(mpilib, "library_version", lambda: "Open MPI v4.1.4, package: Debian")
    monkeypatch.setattr(mpilib, "is_open_mpi_launcher", lambda exe: False)
    assert "not Open MPI's" in mpilib.check_launcher("/x/mpiexec")
    monkeypatch.setattr(mpilib, "is_open_mpi_launcher", lambda exe: True)
    assert mpilib.check_launcher("/usr/bin/mpirun") is None


@need_openmpi
def test_np_with_open_mpi_mpirun_and_mpich_refused(tmp_path):
    """`--np 2 --mpiexec <Open MPI's mpirun>` from the mpich wheel's venv: one line, status 1,
    before any rank starts."""
    folder = tiny_job(tmp_path)
    done = subprocess.run(train_cmd(sys.executable, "--np", 2, "--mpiexec",
                                    shutil.which("mpirun")),
                          cwd=folder, env=env_with(), capture_output=True, text=True, timeout=60)
    assert done.returncode == 1, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "is Open MPI's mpirun, but mpi4py runs on MPICH" in lines[0]


# ---------------------------------------------------------------------------- Slurm
@pytest.fixture(scope="module")
def slurm_lab():
    """A 2-node lab at 1 Gbit/s with Slurm (2 CPUs a node), removed after the module."""
    lab = netlab.up(netlab.Lab(lab_name("m"), netlab.parse_links("1gbit", 2), 2))
    try:
        netlab_slurm.start(lab)
        yield lab
    finally:
        netlab.down(lab.name)
        assert netlab.lab_namespaces(lab.name) == []


def daemons(name):
    """pids of munged, slurmctld and slurmd in lab `name`'s namespaces."""
    out = []
    for ns in netlab.lab_namespaces(name):
        for pid in subprocess.run(["ip", "netns", "pids", ns], capture_output=True,
                                  text=True).stdout.split():
            try:
                if Path(f"/proc/{pid}/comm").read_text().strip() in ("munged", "slurmctld",
                                                                       "slurmd"):
                    out.append(int(pid))
            except OSError:
                pass
    return out


@cluster
@need_lab
@need_slurm
def test_up_slurm_and_down_leave_nothing():
    """`netlab up --slurm`: munged, slurmctld and a slurmd per node, every node idle;
    `netlab down` ends them and removes their files with the lab."""
    name = lab_name("u")
    cli = [sys.executable, "-m", "caffepar.cli", "netlab"]
    up = subprocess.run(cli + ["up", "--name", name, "--slurm"], capture_output=True, text=True,
                        timeout=120)
    try:
        assert up.returncode == 0, up.stderr
        assert "node0 idle, node1 idle" in up.stdout, up.stdout
        pids = daemons(name)
        names = sorted(Path(f"/proc/{p}/comm").read_text().strip() for p in pids)
        assert names == ["munged", "slurmctld", "slurmd", "slurmd"], names
        hosts = subprocess.run(cli + ["login", "--name", name, "--", "srun", "-N", "2",
                                      "hostname"], capture_output=True, text=True, timeout=60)
        assert sorted(hosts.stdout.split()) == ["node0", "node1"], hosts.stderr
    finally:
        down = subprocess.run(cli + ["down", "--name", name], capture_output=True, text=True,
                              timeout=60)
    assert down.returncode == 0, down.stderr
    time.sleep(0.5)
    assert not [p for p in pids if Path(f"/proc/{p}").exists()
                and Path(f"/proc/{p}/stat").read_text().split()[2] != "Z"]
    assert not (Path(netlab.state_dir()) / name).exists()


def sbatch(lab, folder, command, nodes=2, per_node=1, env=None):
    script = folder / "job.sh"
    script.write_text(netlab_slurm.batch_script(command, env))
    done = netlab_slurm.run(lab, ["sbatch", "--parsable", "-N", str(nodes),
                                  "--ntasks-per-node", str(per_node), "-D", str(folder),
                                  "-o", str(folder / "slurm.out"), str(script)],
                            env=env_with(), timeout=60)
    assert done.returncode == 0, done.stderr
    return int(done.stdout.strip().split(";")[0])


def slurm_output(folder):
    path = folder / "slurm.out"
    return path.read_text(errors="replace") if path.exists() else ""


def wait_for(folder, text, timeout=180):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if text in slurm_output(folder):
            return
        time.sleep(0.2)
    raise AssertionError(f"no {text!r}:\n{slurm_output(folder)[-3000:]}")


@cluster
@need_lab
@need_slurm
@pytest.mark.parametrize("per_node", [1, 2])
def test_sbatch_trains_as_hydra(tmp_path, slurm_lab, per_node):
    """sbatch of 2 nodes x 1 (and x 2) ranks, srun --mpi=pmi2 in the script (the README's):
    the same weights as `netlab run` (hydra) of the same job, the nodes' traffic through the
    shaped links."""
    args = ("--parallel", "hybrid", "--mp-threshold", 0)
    hydra = cifar_job(tmp_path / "hydra")
    hydra_run(slurm_lab, hydra, per_node, *args)
    slurm = cifar_job(tmp_path / "slurm")
    before = netlab.counters(slurm_lab)
    job = sbatch(slurm_lab, slurm, train_cmd(sys.executable, *args), per_node=per_node,
                 env=netlab_slurm.LAB_JOB_ENV)
    assert netlab_slurm.wait_job(slurm_lab, job, 150) is not None, slurm_output(slurm)
    after = netlab.counters(slurm_lab)
    out = slurm_output(slurm)
    assert "Optimization Done." in out and "pmi2" not in out, out[-3000:]
    assert f"Parallel run on {2 * per_node} rank(s)" in out
    assert_same_weights(final(slurm), final(hydra))
    for node in range(2):       # 10 iterations of cifar10_quick's gradients: ~1 MB
        assert min(after[node][k] - before[node][k] for k in (0, 1)) > 500_000, (before, after)


@cluster
@need_lab
@need_slurm
def test_srun_under_salloc(tmp_path, slurm_lab):
    """salloc on the login node, srun in it: the job trains to the weights of hydra's run."""
    hydra = cifar_job(tmp_path / "hydra")
    hydra_run(slurm_lab, hydra, 1, "--parallel", "data")
    folder = cifar_job(tmp_path / "salloc")
    done = subprocess.run(netlab_slurm.in_hub(slurm_lab, [
        "salloc", "-N", "2", "--ntasks-per-node", "1", "srun", "--mpi=pmi2",
        *train_cmd(sys.executable, "--parallel", "data")]), cwd=folder,
        env=netlab_slurm.environment(slurm_lab, env_with(**netlab_slurm.LAB_JOB_ENV)),
        capture_output=True, text=True, timeout=180)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    assert "Granted job allocation" in out and "Optimization Done." in out
    assert_same_weights(final(folder), final(hydra))


@cluster
@need_lab
@need_slurm
@need_openmpi
def test_open_mpi_under_srun_pmix(tmp_path, slurm_lab):
    """mpi4py on Open MPI started by `srun --mpi=pmix` (PMIx from Slurm; its client folders on
    each node's own /var/tmp, mpi.conf's PMIxCliTmpDirBase): the weights of hydra's MPICH run."""
    hydra = cifar_job(tmp_path / "hydra")
    hydra_run(slurm_lab, hydra, 1, "--parallel", "data")
    folder = cifar_job(tmp_path / "pmix")
    ompi = {"OMPI_MCA_pml": "ob1", "OMPI_MCA_btl": "tcp,self,vader",
            "OMPI_MCA_btl_tcp_if_include": "eth0"}
    done = subprocess.run(netlab_slurm.in_hub(slurm_lab, [
        "srun", "-N", "2", "--ntasks-per-node", "1", "--mpi=pmix",
        *train_cmd(OPENMPI_PYTHON, "--parallel", "data")]), cwd=folder,
        env=netlab_slurm.environment(slurm_lab, env_with(**ompi)), capture_output=True,
        text=True, timeout=180)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    assert_same_weights(final(folder), final(hydra))


@cluster
@need_lab
@need_slurm
def test_scancel_snapshots_as_sigterm(tmp_path, slurm_lab):
    """scancel of a running job: every rank gets SIGTERM from Slurm, and the job snapshots
    and stops as one process does on SIGTERM."""
    folder = tiny_job(tmp_path)
    job = sbatch(slurm_lab, folder, train_cmd(sys.executable), env=netlab_slurm.LAB_JOB_ENV)
    wait_for(folder, "Iteration 20,")
    netlab_slurm.run(slurm_lab, ["scancel", str(job)], timeout=30)
    took = netlab_slurm.wait_job(slurm_lab, job, 60)
    out = slurm_output(folder)
    assert took is not None, out[-3000:]
    assert "Signal SIGTERM received: stop" in out and "Optimization stopped early." in out, \
        out[-3000:]
    state = sorted((folder / "snap").glob("tiny_iter_*.solverstate"))
    assert len(state) == 1, state
    from caffepar.io.weights import read_caffemodel
    assert read_caffemodel(state[0].with_suffix(".caffemodel")).layers
    assert "Traceback" not in out


@cluster
@need_lab
@need_slurm
@pytest.mark.parametrize("per_node", [1, 2])
def test_node_lost_ends_the_job_naming_rank_and_node(tmp_path, per_node):
    """node1's slurmd killed mid-job (every process of the node with it, as a crashed
    machine): within the watchdog (5 s here) + 60 s the job has left Slurm's queue, and one
    line names the rank and the node that was lost."""
    lab = netlab.up(netlab.Lab(lab_name(f"k{per_node}"), netlab.parse_links("1gbit", 2), 2))
    try:
        netlab_slurm.start(lab)
        folder = tiny_job(tmp_path)
        job = sbatch(lab, folder, train_cmd(sys.executable, "--watchdog", 5),
                     per_node=per_node, env=netlab_slurm.LAB_JOB_ENV)
        wait_for(folder, "Iteration 20,")
        netlab_slurm.kill_node(lab, 1)
        took = netlab_slurm.wait_job(lab, job, 5 + 60)
        out = slurm_output(folder)
    finally:
        netlab.down(lab.name)
    assert took is not None, out[-3000:]
    lost = [line for line in out.splitlines() if line.startswith("caffepar:")]
    assert lost and all(re.search(rf"rank {per_node}\b.* on node1\b|rank {per_node} on node1",
                                  line) for line in lost), out[-3000:]
    assert "Timeout (" not in out, out[-3000:]       # the watchdog's line, not its last resort


# ------------------------------------------------------------------------- Open MPI
def openmpi_env(**extra):
    return env_with(**extra)


@cluster
@need_lab
@need_openmpi
@pytest.mark.parametrize("mode", ["data", "hybrid", "overlap"])
def test_open_mpi_on_the_lab_same_weights_as_mpich(tmp_path, mode):
    """mpi4py on Open MPI 4.1, its mpirun starting the ranks on the lab's two nodes over TCP
    (`caffepar netlab run` from the Open MPI venv): the weights of the mpich wheel's run."""
    args = {"data": ("--parallel", "data"), "hybrid": ("--parallel", "hybrid",
                                                       "--mp-threshold", 0),
            "overlap": ("--parallel", "data", "--overlap", "--bucket-mb", 0.2)}[mode]
    mpich = cifar_job(tmp_path / "mpich")
    done = subprocess.run(train_cmd(sys.executable, "--np", 2, *args), cwd=mpich,
                          env=env_with(), capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    folder = cifar_job(tmp_path / "openmpi")
    name = lab_name(f"o{mode[0]}")
    done = subprocess.run([str(OPENMPI_PYTHON), "-m", "caffepar.cli", "netlab", "run",
                           "--name", name, "--nodes", "2", "--link", "1gbit", "--",
                           "train", "--solver", "solver.prototxt", *map(str, args),
                           "--log-all-ranks"],
                          cwd=folder, env=openmpi_env(), capture_output=True, text=True,
                          timeout=180)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    assert netlab.lab_namespaces(name) == []
    assert_same_weights(final(folder), final(mpich))


def openmpi_train(folder, *args, launcher=None, env=None):
    cmd = launcher or []
    return subprocess.Popen(cmd + train_cmd(OPENMPI_PYTHON, *args), cwd=folder,
                            env=openmpi_env(**(env or {})), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def finish(proc, timeout):
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"still running after {timeout} s:\n{out[-3000:]}")
    return proc.returncode, out


@cluster
@need_openmpi
def test_open_mpi_failed_rank_ends_the_job_nonzero(tmp_path):
    """A rank that fails (a layer raises on rank 1) ends the job with status 1 and one line
    naming it: under `--np` (caffepar's launcher over Open MPI's mpirun) and under a plain
    `mpirun -n 2`."""
    folder = tiny_job(tmp_path, fault={"rank": 1, "at": 5, "do": "raise"})
    code, out = finish(openmpi_train(folder, "--np", 2), 90)
    assert code == 1, out[-3000:]
    assert "[rank 1] caffepar: error: ValueError: injected" in out, out[-3000:]
    root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    code, out = finish(openmpi_train(folder, launcher=["mpirun", *root, "--oversubscribe",
                                                       "-n", "2"]), 90)
    assert code != 0, out[-3000:]
    assert "[rank 1] caffepar: error: ValueError: injected" in out, out[-3000:]


@cluster
@need_openmpi
def test_open_mpi_launcher_signals_and_watchdog(tmp_path):
    """Under `--np` with Open MPI: SIGTERM to the launcher snapshots and stops (status 0, as
    one process; with CAFFEPAR_TRANSPORT=tcp, Open MPI's tcp BTL); a rank that hangs is named
    by the watchdog, status 1."""
    folder = tiny_job(tmp_path / "term")
    proc = openmpi_train(folder, "--np", 2, env={"CAFFEPAR_TRANSPORT": "tcp"})
    lines = []
    deadline = time.monotonic() + 90
    for line in proc.stdout:
        lines.append(line)
        if "Iteration 20," in line or time.monotonic() > deadline:
            break
    os.kill(proc.pid, signal.SIGTERM)
    code, rest = finish(proc, 60)
    out = "".join(lines) + rest
    assert code == 0, out[-3000:]
    assert "Optimization stopped early." in out and list((folder / "snap").glob("*.solverstate"))
    folder = tiny_job(tmp_path / "hang", fault={"rank": 1, "at": 30, "do": "hang"})
    code, out = finish(openmpi_train(folder, "--np", 2, "--watchdog", 3), 90)
    assert code == 1, out[-3000:]
    assert re.search(r"rank 1 \(is at #\d+\) stopped before collective", out), out[-3000:]
