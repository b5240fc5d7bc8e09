"""Slurm on the network lab (`caffepar netlab up --slurm`): a scheduler as users' clusters have,
on the lab's nodes, so that `sbatch`, `salloc`, `srun` and `scancel` run caffepar as they would
there.

The controller (slurmctld) and the authentication daemon (munged, with a key of the lab's own)
run in the hub's network namespace, the login node; one slurmd per node runs in the node's
network namespace with the node's own hostname, mounts and PID namespace, as the lab's hydra
launcher enters a node: its own /dev/shm and /var/tmp (so MPI's shared memory and PMIx's files
stay on the node), and every process of the node dies with its slurmd, as with a crashed machine.
slurmd is started through nsenter and unshare, not `ip netns exec`, which remounts /sys without
its cgroup filesystem (slurmd then fails to start). Process tracking and task launch need no
cgroups (proctrack/linuxproc, task/none). Everything Slurm writes (configuration, state, spool,
pid and log files, per node where it is a node's) lives in the lab's state folder, which
`netlab down` removes with the namespaces and their processes. Nothing of the machine's own
Slurm or munge (/etc/slurm, /etc/munge, their services) is read or changed.
"""
import os
import shutil
import signal
import subprocess
import time

from caffepar.errors import CaffeparError

#: The programs a Slurm lab runs, and the Debian packages that have them.
PROGRAMS = {"munged": "munge", "slurmctld": "slurmctld", "slurmd": "slurmd",
            "sbatch": "slurm-client", "srun": "slurm-client", "salloc": "slurm-client",
            "scancel": "slurm-client", "squeue": "slurm-client", "sinfo": "slurm-client"}
CONF_VAR = "SLURM_CONF"
#: Seconds after which slurmctld marks a node that stopped answering DOWN (and ends its jobs).
NODE_TIMEOUT = 20


def missing_programs():
    """None when this machine has Slurm and munge, else the one line saying what to install."""
    missing = sorted({pkg for prog, pkg in PROGRAMS.items()
                      if shutil.which(prog, path=_path()) is None})
    if missing:
        return (f"netlab --slurm: needs Slurm and munge ({', '.join(missing)} missing): "
                "install them, e.g. apt-get install slurm-wlm munge")
    return None


def _path():
    return os.environ.get("PATH", "") + os.pathsep + "/usr/sbin" + os.pathsep + "/sbin"


def _which(prog):
    return shutil.which(prog, path=_path())


def folder(lab):
    return os.path.join(lab.folder, "slurm")


def conf_path(lab):
    return os.path.join(folder(lab), "slurm.conf")


#: The login node's hostname and NodeName-like name of the controller.
HUB = "hub"


def node_name(node):
    return f"node{node}"


def munge_socket(lab):
    return os.path.join(folder(lab), "munge", "munge.socket")


def write_conf(lab, cpus=None):
    """slurm.conf for the lab: the controller on the hub, node0..nodeN at their lab addresses,
    each with CPUs for its ranks (cores are shared by every node: the configured count is used,
    not the hardware's); per-node spool, pid and log paths (%n)."""
    base = folder(lab)
    cpus = cpus or max(2, lab.ranks_per_node)
    from caffepar.netlab import HUB_ADDRESS
    nodes = "\n".join(f"NodeName={node_name(n)} NodeAddr={lab.address(n)} CPUs={cpus} "
                      "State=UNKNOWN" for n in range(lab.nodes))
    text = f"""\
# The network lab's Slurm cluster (written by caffepar netlab up --slurm).
ClusterName=caffepar{lab.name}
SlurmctldHost={HUB}({HUB_ADDRESS})
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={munge_socket(lab)}
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SwitchType=switch/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
SlurmdTimeout={NODE_TIMEOUT}
KillWait=10
MinJobAge=60
StateSaveLocation={base}/ctld/state
SlurmctldPidFile={base}/ctld/slurmctld.pid
SlurmctldLogFile={base}/ctld/slurmctld.log
SlurmdSpoolDir={base}/nodes/%n/spool
SlurmdPidFile={base}/nodes/%n/slurmd.pid
SlurmdLogFile={base}/nodes/%n/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
{nodes}
PartitionName=lab Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""
    for sub in ("munge", "ctld/state", *(f"nodes/{node_name(n)}/spool" for n in range(lab.nodes))):
        os.makedirs(os.path.join(base, sub), exist_ok=True)
    with open(conf_path(lab), "w", encoding="utf-8") as f:
        f.write(text)
    # srun --mpi=pmix: the PMIx clients' folders on the node's own /var/tmp (nodes share /tmp)
    with open(os.path.join(base, "mpi.conf"), "w", encoding="utf-8") as f:
        f.write("PMIxCliTmpDirBase=/var/tmp\n")
    return conf_path(lab)


def environment(lab, env=None):
    """The environment of a Slurm command on the lab (its slurm.conf)."""
    env = dict(os.environ if env is None else env)
    env[CONF_VAR] = conf_path(lab)
    return env


def in_hub(lab, argv):
    """argv run on the login node: in the hub's network namespace."""
    return ["nsenter", f"--net=/run/netns/{lab.hub}", "--"] + list(argv)


_NODE = ("mount -t tmpfs -o mode=1777 tmpfs /dev/shm && "
         "mount -t tmpfs -o mode=1777 tmpfs /var/tmp && hostname \"$1\" && shift && exec \"$@\"")


def start(lab):
    """munged, slurmctld and a slurmd per node for `lab` (up already); waits until every node
    is idle. On a failure, the one line says what and where its log is (`netlab down` removes
    what was started)."""
    message = missing_programs()
    if message:
        raise CaffeparError(message)
    base = folder(lab)
    write_conf(lab)
    env = environment(lab)
    key = os.path.join(base, "munge", "munge.key")
    with open(os.open(key, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o400), "wb") as f:
        f.write(os.urandom(1024))
    munge = os.path.join(base, "munge")
    _daemon(lab, "munged", in_hub(lab, [
        _which("munged"), "--force", f"--socket={munge_socket(lab)}", f"--key-file={key}",
        f"--pid-file={munge}/munged.pid", f"--log-file={munge}/munged.log",
        f"--seed-file={munge}/munged.seed"]), env, os.path.join(munge, "munged.log"))
    _wait(lambda: os.path.exists(munge_socket(lab)), 15, "munged did not start",
          os.path.join(munge, "munged.log"))
    _daemon(lab, "slurmctld", in_hub(lab, [
        "unshare", "--uts", "--", "/bin/sh", "-c", 'hostname "$1" && shift && exec "$@"',
        "hub", HUB, _which("slurmctld"), "-i"]), env,
        os.path.join(base, "ctld", "slurmctld.log"))
    for node in range(lab.nodes):
        name = node_name(node)
        log = os.path.join(base, "nodes", name, "slurmd.log")
        cmd = ["nsenter", f"--net=/run/netns/{lab.namespace(node)}", "--", "unshare", "--uts",
               "--mount", "--ipc", "--pid", "--fork", "--kill-child", "--mount-proc", "--",
               "/bin/sh", "-c", _NODE, "node", name, _which("slurmd"), "-D", "-N", name]
        _daemon(lab, f"slurmd {name}", cmd, env, log, foreground=True)
    _wait(lambda: _idle(lab), 60, "the nodes did not come up idle",
          os.path.join(base, "ctld", "slurmctld.log"))


def _daemon(lab, what, cmd, env, log, foreground=False):
    """Start a daemon, detached from this process (its own session, no terminal)."""
    out = open(log + ".out", "ab")
    try:
        proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    finally:
        out.close()
    if not foreground:
        code = proc.wait(30)
        if code:
            raise CaffeparError(f"netlab --slurm: {what} failed to start (status {code}); see "
                                f"{log} and {log}.out")
    return proc


def _wait(test, seconds, what, log):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if test():
            return
        time.sleep(0.2)
    raise CaffeparError(f"netlab --slurm: {what} within {seconds} s; see {log}")


def sinfo(lab):
    """{node name: state} as slurmctld sees them ({} while it does not answer)."""
    done = subprocess.run(in_hub(lab, [_which("sinfo"), "-h", "-N", "-o", "%N %T"]),
                          env=environment(lab), capture_output=True, text=True, timeout=30)
    if done.returncode:
        return {}
    return dict(line.split()[:2] for line in done.stdout.splitlines() if line.strip())


def _idle(lab):
    states = sinfo(lab)
    return len(states) == lab.nodes and all(s.rstrip("*") == "idle" for s in states.values())


def run(lab, argv, env=None, **kw):
    """A Slurm command (sbatch, squeue, scancel ...) run on the login node, its output taken."""
    return subprocess.run(in_hub(lab, argv), env=environment(lab, env), capture_output=True,
                          text=True, **kw)


#: What a lab job needs beyond a real cluster's: MPI between nodes on the node's one link
#: (libfabric's tcp provider on eth0, UCX on tcp), never shared memory between namespaces.
LAB_JOB_ENV = {"FI_PROVIDER": "tcp", "FI_TCP_IFACE": "eth0", "UCX_TLS": "tcp,self",
               "UCX_NET_DEVICES": "eth0"}


def batch_script(command, env=None):
    """An sbatch script running `command` (a list) as one srun step on the allocation, each
    task a rank through Slurm's pmi2 (the recipe of the README), with `env` exported."""
    import shlex
    lines = ["#!/bin/sh", "#SBATCH --no-requeue"]
    lines += [f"export {k}={shlex.quote(str(v))}" for k, v in (env or {}).items()]
    lines += ["srun --mpi=pmi2 --kill-on-bad-exit=1 " + " ".join(map(shlex.quote, command))]
    return "\n".join(lines) + "\n"


def job_state(lab, job):
    """The job's state (RUNNING, COMPLETING ...), or None once Slurm no longer lists it."""
    done = run(lab, [_which("squeue"), "-h", "-j", str(job), "-o", "%T"], timeout=30)
    state = done.stdout.strip()
    return state or None


def wait_job(lab, job, timeout):
    """Seconds until the job has left the queue (None if it had not after `timeout`)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if job_state(lab, job) is None:
            return time.monotonic() - t0
        time.sleep(0.25)
    return None


def node_leader(lab, node):
    """The pid of node's slurmd (the first process of its PID namespace), or None."""
    from caffepar.netlab import _run
    for pid in _run("ip", "netns", "pids", lab.namespace(node), check=False).stdout.split():
        try:
            with open(f"/proc/{pid}/comm", encoding="ascii") as f:
                if f.read().strip() == "slurmd":
                    return int(pid)
        except OSError:
            continue
    return None


def kill_node(lab, node):
    """Kill node's slurmd: every process of the node dies with it (its PID namespace), as on a
    machine that crashed."""
    pid = node_leader(lab, node)
    if pid is None:
        raise CaffeparError(f"netlab --slurm: node{node} has no slurmd")
    os.kill(pid, signal.SIGKILL)
    return pid


def is_up(lab):
    return os.path.exists(conf_path(lab))
