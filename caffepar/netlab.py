"""`caffepar netlab`: a cluster on one machine, to measure what caffepar's parallel plans gain
over a real network path.

Each node is a Linux network namespace with one veth link to a bridge (the switch, in a hub
namespace of its own); each link is shaped with tc's token bucket (tbf) on both of its ends, so
a node's traffic in either direction is capped at the link's rate. Nothing touches the host's
own interfaces: every address lives inside the lab's namespaces, in 198.18.0.0/15 (RFC 2544,
reserved for network benchmarks).

A job is launched as on a cluster: hydra's mpiexec (run on the hub, the "login node") starts one
process manager proxy per node through its ssh launcher, whose program here enters the node
instead of logging in. The node gets its network namespace plus private mount (its own /dev/shm
and /sys), UTS (its own hostname) and PID namespaces: all namespaces share one kernel, so a
transport free to use shared memory or cross-memory attach between "nodes" would bypass the
link. Ranks of one node talk through MPICH's shared memory; ranks of different nodes through
UCX (or libfabric) limited to TCP on the node's link. Where mpi4py runs on Open MPI, its mpirun
starts the job the same way (its rsh launcher's program is the same), on its tcp BTL. With
`up --slurm` the lab also runs Slurm (caffepar.netlab_slurm).
"""
import ipaddress
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import click

from caffepar.errors import CaffeparError
from caffepar.parallel.launch import JOB_DIR_VAR, Job, find_mpiexec

SUBNET = ipaddress.ip_network("198.18.0.0/24")
HUB_ADDRESS = SUBNET[1]
FIRST_NODE = 10
STATE_DIR_VAR = "CAFFEPAR_NETLAB_DIR"
DEFAULT_NAME = "cpl"
CAP_NET_ADMIN, CAP_SYS_ADMIN = 12, 21

#: The environment every rank of a lab job gets: MPI between nodes over TCP only, on the link.
RANK_ENV = {"UCX_TLS": "tcp,self", "UCX_NET_DEVICES": "eth0", "FI_PROVIDER": "tcp",
            "FI_TCP_IFACE": "eth0"}
#: ...and what must not leak in from the caller (NOLOCAL would keep a node's ranks off its
#: shared memory; the launcher's pid means nothing inside a node's PID namespace).
RANK_ENV_DROP = ("MPIR_CVAR_NOLOCAL", "CAFFEPAR_TRANSPORT", "CAFFEPAR_LAUNCHER_PID",
                 "OMPI_MCA_pml", "OMPI_MCA_btl")

_RATE = re.compile(r"^(\d+(?:\.\d+)?)(k|m|g)?bit$")


def parse_rate(text):
    """Bits per second of a link rate (`100mbit`, `1gbit`, `2.5gbit`), None for `unshaped`."""
    text = text.strip().lower()
    if text in ("unshaped", "none"):
        return None
    found = _RATE.match(text)
    if not found or float(found.group(1)) <= 0:
        raise CaffeparError(f"bad link rate {text!r}: expected e.g. 100mbit, 1gbit, 10gbit "
                            "or unshaped")
    return int(float(found.group(1)) * {None: 1, "k": 1e3, "m": 1e6, "g": 1e9}[found.group(2)])


def format_rate(bits):
    if bits is None:
        return "unshaped"
    for unit, scale in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if bits >= scale:
            return f"{bits / scale:g}{unit}"
    return f"{bits}bit"


def parse_links(text, nodes):
    """One rate per node from `RATE` (every node) or `RATE,RATE,...` (one per node)."""
    rates = [parse_rate(part) for part in text.split(",")]
    if len(rates) == 1:
        return rates * nodes
    if len(rates) != nodes:
        raise CaffeparError(f"--link gives {len(rates)} rates for {nodes} nodes: give one rate, "
                            "or one per node")
    return rates


def missing_privileges():
    """None when this process can build a lab, else the one line saying what is missing."""
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return ("netlab: needs the `ip` and `tc` commands (iproute2): install it, "
                "e.g. apt-get install iproute2")
    if shutil.which("unshare") is None or shutil.which("nsenter") is None:
        return ("netlab: needs `unshare` and `nsenter` (util-linux): install it, "
                "e.g. apt-get install util-linux")
    caps = effective_capabilities()
    missing = [name for bit, name in ((CAP_NET_ADMIN, "CAP_NET_ADMIN"),
                                      (CAP_SYS_ADMIN, "CAP_SYS_ADMIN")) if not caps >> bit & 1]
    if missing:
        return (f"netlab: needs root ({' and '.join(missing)} missing, to make network "
                "namespaces and shape their links): run it with sudo, or in a container "
                "started with --cap-add NET_ADMIN --cap-add SYS_ADMIN (or --privileged)")
    return None


def effective_capabilities():
    """This process's effective capability bits (all of them for root where /proc is absent)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return int(line.split()[1], 16)
    except OSError:
        pass
    return -1 if os.geteuid() == 0 else 0


def check_privileges():
    message = missing_privileges()
    if message:
        raise CaffeparError(message)


# ----------------------------------------------------------------------------- the lab
def state_dir():
    return os.environ.get(STATE_DIR_VAR) or "/run/caffepar-netlab"


def _run(*cmd, check=True):
    done = subprocess.run([str(c) for c in cmd], capture_output=True, text=True)
    if check and done.returncode:
        raise CaffeparError(f"netlab: `{' '.join(map(str, cmd))}` failed: "
                            f"{(done.stderr or done.stdout).strip()}")
    return done


class Lab:
    """A lab's layout: its name (prefix of its namespaces), nodes, ranks per node and rates."""

    def __init__(self, name, rates, ranks_per_node=1):
        if not re.fullmatch(r"[a-z][a-z0-9]{0,11}", name):
            raise CaffeparError(f"bad lab name {name!r}: 1-12 lower-case letters and digits, "
                                "starting with a letter")
        if not 1 <= len(rates) <= 200:
            raise CaffeparError(f"a lab has 1 to 200 nodes, not {len(rates)}")
        self.name, self.rates, self.ranks_per_node = name, list(rates), int(ranks_per_node)

    @property
    def nodes(self):
        return len(self.rates)

    @property
    def hub(self):
        return f"{self.name}-hub"

    def namespace(self, node):
        return f"{self.name}-node{node}"

    @staticmethod
    def address(node):
        return SUBNET[FIRST_NODE + node]

    @property
    def folder(self):
        return os.path.join(state_dir(), self.name)

    @property
    def launcher(self):
        return os.path.join(self.folder, "enter-node")

    def to_dict(self):
        return {"name": self.name, "rates": self.rates, "ranks_per_node": self.ranks_per_node}

    @classmethod
    def load(cls, name):
        path = os.path.join(state_dir(), name, "lab.json")
        try:
            with open(path, encoding="utf-8") as f:
                doc = json.load(f)
        except FileNotFoundError:
            return None
        return cls(doc["name"], doc["rates"], doc["ranks_per_node"])

    def hosts(self):
        """hydra's -hosts: each node's address with its ranks."""
        return ",".join(f"{self.address(n)}:{self.ranks_per_node}" for n in range(self.nodes))


def lab_namespaces(name):
    """The namespaces of lab `name` that exist (also those a killed run left)."""
    done = _run("ip", "netns", "list", check=False)
    names = [line.split()[0] for line in done.stdout.splitlines() if line.strip()]
    return sorted(n for n in names if re.fullmatch(rf"{re.escape(name)}-(hub|node\d+)", n))


def up(lab):
    """Build the lab (the hub's bridge, a namespace and shaped link per node); on any failure
    remove what was made."""
    check_privileges()
    if lab_namespaces(lab.name):
        raise CaffeparError(f"netlab: a lab named {lab.name!r} is up already "
                            f"(caffepar netlab down --name {lab.name} removes it)")
    try:
        _run("ip", "netns", "add", lab.hub)
        _run("ip", "-n", lab.hub, "link", "set", "lo", "up")
        _run("ip", "-n", lab.hub, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", lab.hub, "addr", "add", f"{HUB_ADDRESS}/{SUBNET.prefixlen}",
             "dev", "br0")
        _run("ip", "-n", lab.hub, "link", "set", "br0", "up")
        for node in range(lab.nodes):
            ns = lab.namespace(node)
            _run("ip", "netns", "add", ns)
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            _run("ip", "-n", lab.hub, "link", "add", f"n{node}", "type", "veth",
                 "peer", "name", "eth0", "netns", ns)
            _run("ip", "-n", lab.hub, "link", "set", f"n{node}", "master", "br0", "up")
            _run("ip", "-n", ns, "addr", "add", f"{lab.address(node)}/{SUBNET.prefixlen}",
                 "dev", "eth0")
            _run("ip", "-n", ns, "link", "set", "eth0", "up")
            shape(lab, node, lab.rates[node])
        os.makedirs(lab.folder, exist_ok=True)
        with open(os.path.join(lab.folder, "lab.json"), "w", encoding="utf-8") as f:
            json.dump(lab.to_dict(), f)
        write_launcher(lab)
    except BaseException:
        down(lab.name)
        raise
    return lab


def _burst(bits):
    """tbf's bucket: 4 ms at the rate (the kernel's timer tick at HZ=250), at least 64 KiB."""
    return max(64 * 1024, int(bits / 8 / 250))


def shape(lab, node, bits):
    """Cap node's link at `bits`/s in both directions (egress of both veth ends); None: no cap."""
    for ns, dev in ((lab.namespace(node), "eth0"), (lab.hub, f"n{node}")):
        _run("tc", "-n", ns, "qdisc", "del", "dev", dev, "root", check=False)
        if bits is not None:
            _run("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{bits}bit",
                 "burst", str(_burst(bits)), "latency", "100ms")


def set_link(lab, node, state):
    """Take node's link down or up (both ends), as a cable pulled and put back."""
    for ns, dev in ((lab.namespace(node), "eth0"), (lab.hub, f"n{node}")):
        _run("ip", "-n", ns, "link", "set", dev, state)


def down(name):
    """Remove lab `name`: end the processes left in its nodes, delete its namespaces (their
    links and bridge go with them) and its state. Returns the namespaces removed."""
    namespaces = lab_namespaces(name)
    for ns in namespaces:
        for pid in _run("ip", "netns", "pids", ns, check=False).stdout.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
    for ns in namespaces:
        _run("ip", "netns", "del", ns, check=False)
    shutil.rmtree(os.path.join(state_dir(), name), ignore_errors=True)
    return namespaces


def counters(lab):
    """{node: (bytes the node sent, bytes it received)} over its link, read at the hub's end."""
    out = {}
    for node in range(lab.nodes):
        hub_side = _link_stats(lab.hub, f"n{node}")
        out[node] = (hub_side["rx"], hub_side["tx"])
    return out


def _link_stats(ns, dev):
    done = _run("ip", "-n", ns, "-s", "-j", "link", "show", "dev", dev)
    stats = json.loads(done.stdout)[0]["stats64"]
    return {"rx": stats["rx"]["bytes"], "tx": stats["tx"]["bytes"]}


def qdisc_bytes(lab, node):
    """Bytes through the tbf qdisc at each end of node's link: (node's egress, hub's egress)."""
    out = []
    for ns, dev in ((lab.namespace(node), "eth0"), (lab.hub, f"n{node}")):
        done = _run("tc", "-n", ns, "-s", "-j", "qdisc", "show", "dev", dev)
        rows = [q for q in json.loads(done.stdout) if q.get("kind") == "tbf"]
        out.append(rows[0]["bytes"] if rows else None)
    return tuple(out)


# ------------------------------------------------------------------------ entering a node
_LAUNCHER = """#!/bin/sh
# hydra's ssh launcher calls this as `PROGRAM [ssh options] HOST COMMAND`: instead of logging in
# to HOST, enter that lab node (its network namespace; private mount, UTS and PID namespaces
# with its own /dev/shm, /sys and hostname) and run COMMAND there, as sshd would.
while [ "${{1#-}}" != "$1" ]; do shift; done
host=$1; shift
case "$host" in
{cases}
*) echo "netlab: no node $host in lab {name}" >&2; exit 255;;
esac
exec nsenter --net=/run/netns/$ns -- unshare --mount --uts --pid --fork --kill-child \\
    --mount-proc -- /bin/sh -c 'mount -t tmpfs -o mode=1777 tmpfs /dev/shm &&
umount -l /sys && mount -t sysfs sysfs /sys && hostname "$1" && shift && exec /bin/sh -c "$*"' \\
    enter "$node" "$@"
"""


def write_launcher(lab):
    cases = "\n".join(f"{lab.address(n)}|node{n}) ns={lab.namespace(n)}; node=node{n};;"
                      for n in range(lab.nodes))
    with open(lab.launcher, "w", encoding="utf-8") as f:
        f.write(_LAUNCHER.format(cases=cases, name=lab.name))
    os.chmod(lab.launcher, 0o755)


def mpiexec_command(lab, ranks, program, mpiexec=None):
    """The mpiexec command that runs `program` (a list) on `ranks` ranks of the lab, filled
    node by node (ranks 0..R-1 on node0, ...); run from the hub."""
    exe = find_mpiexec(mpiexec)
    if exe is None:
        raise CaffeparError("netlab: needs hydra's mpiexec (pip install mpich)")
    return ["ip", "netns", "exec", lab.hub, exe, "-localhost", str(HUB_ADDRESS),
            "-hosts", lab.hosts(), "-launcher", "ssh", "-launcher-exec", lab.launcher,
            "-n", str(ranks)] + list(program)


def mpirun_command(lab, ranks, program, mpirun=None):
    """Open MPI's mpirun command that runs `program` on `ranks` ranks of the lab, node by node;
    run from the hub. Its rsh launcher's program is the lab's, which enters a node instead of
    logging in; between nodes the ob1 PML's tcp BTL on the lab's subnet, within a node shared
    memory (vader)."""
    exe = mpirun or shutil.which("mpirun")
    if exe is None:
        raise CaffeparError("netlab: needs Open MPI's mpirun (e.g. apt-get install openmpi-bin)")
    subnet = str(SUBNET)
    hosts = ",".join(f"{lab.address(n)}:{lab.ranks_per_node}" for n in range(lab.nodes))
    root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    return (["ip", "netns", "exec", lab.hub, exe] + root +
            ["--oversubscribe", "--bind-to", "none", "--mca", "plm_rsh_agent", lab.launcher,
             "--mca", "oob_tcp_if_include", subnet, "--mca", "btl_tcp_if_include", subnet,
             "--mca", "pml", "ob1", "--mca", "btl", "tcp,self,vader",
             "-H", hosts, "-n", str(ranks)] + list(program))


def rank_environment(threads=1):
    env = {k: v for k, v in os.environ.items() if k not in RANK_ENV_DROP}
    env.update(RANK_ENV)
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        env[var] = str(threads)
    env["CAFFEPAR_MPI"] = "1"
    return env


def run_job(lab, argv, threads=1, mpiexec=None, ranks=None):
    """Run `caffepar <argv>` on every rank of the lab through caffepar's launcher (failures
    reported once, signals forwarded); the exit status a one-process run would have had."""
    ranks = ranks or lab.nodes * lab.ranks_per_node
    env = rank_environment(threads)
    folder = tempfile.mkdtemp(prefix="caffepar-job-")
    env[JOB_DIR_VAR] = folder
    program = [sys.executable, "-m", "caffepar.cli"] + list(argv)
    from caffepar.parallel.mpilib import family
    if family() == "openmpi":       # mpi4py built against Open MPI: its mpirun starts the ranks
        cmd = mpirun_command(lab, ranks, program, mpiexec)
    else:
        cmd = mpiexec_command(lab, ranks, program, mpiexec)
    try:
        status = LabJob(cmd, env, folder, ranks, lab.ranks_per_node).run()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return 128 - status if status < 0 else status


class LabJob(Job):
    """caffepar's launcher for a lab job. The ranks live in the nodes' PID namespaces, out of
    the launcher's reach: a signal the launcher gets goes to mpiexec, which forwards it to
    every rank through the nodes' proxies. Once a rank has ended the job with a reason,
    mpiexec gets GRACE seconds to end the others: a node cut off from the network keeps it
    waiting for that node's proxy forever, so then the launcher ends mpiexec and its
    launchers (each node's processes die with theirs). Report lines name each rank's node."""

    GRACE = 5.0

    def __init__(self, cmd, env, folder, size, ranks_per_node=1):
        super().__init__(cmd, env, folder, size)
        self.ranks_per_node = ranks_per_node
        self.failed_at = None

    def _forward(self, signum, frame):
        self.received.append(signum)
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.kill(self.proc.pid, signum)
            except ProcessLookupError:
                pass

    def _wait(self):
        super()._wait()
        if self.proc.poll() is not None:
            return
        if self.failed_at is None:
            if any(code for code, _line in self._ends().values()):
                self.failed_at = time.monotonic()
        elif time.monotonic() - self.failed_at > self.GRACE:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def _ends(self):
        node = lambda m: f"{m.group(0)} (node{int(m.group(1)) // self.ranks_per_node})"
        out = {}
        for rank, (code, line) in super()._ends().items():
            head, sep, text = line.partition("] ")
            if sep and head.startswith("[rank") and not re.search(r"\bnode\d", text):
                line = head + sep + re.sub(r"\brank (\d+)\b", node, text)
            out[rank] = (code, line)
        return out


# ------------------------------------------------------------------------------- the CLI
def _name_option(fn):
    return click.option("--name", default=DEFAULT_NAME, show_default=True,
                        help="The lab's name (prefix of its namespaces).")(fn)


def _layout_options(fn):
    for flag in reversed([
        click.option("--nodes", type=click.IntRange(1, 200), default=None,
                     help="Nodes (network namespaces) [default: 2]."),
        click.option("--ranks-per-node", type=click.IntRange(1, 64), default=None,
                     help="MPI ranks on each node [default: 1]."),
        click.option("--link", default=None,
                     help="Each node's link rate: 100mbit, 1gbit, 10gbit, unshaped; or one "
                          "rate per node, comma-separated (a slow node) [default: 1gbit]."),
    ]):
        fn = flag(fn)
    return fn


def _lab_from_options(name, nodes, ranks_per_node, link):
    nodes = nodes or 2
    return Lab(name, parse_links(link or "1gbit", nodes), ranks_per_node or 1)


@click.group("netlab")
def netlab_group():
    """A cluster on this machine: nodes as network namespaces on shaped links (needs root)."""


@netlab_group.command("up")
@_name_option
@_layout_options
@click.option("--slurm", is_flag=True,
              help="Also run Slurm on the lab: munged and slurmctld on the hub (the login "
                   "node), a slurmd per node; `netlab login -- sbatch ...` submits to it.")
def netlab_up(name, nodes, ranks_per_node, link, slurm):
    """Build a lab: NODES namespaces on one bridge, each link shaped to its rate."""
    if slurm:
        from caffepar import netlab_slurm
        message = netlab_slurm.missing_programs()
        if message:
            raise CaffeparError(message)
    lab = up(_lab_from_options(name, nodes, ranks_per_node, link))
    if slurm:
        from caffepar import netlab_slurm
        try:
            netlab_slurm.start(lab)
        except BaseException:
            down(lab.name)
            raise
    click.echo(describe(lab))


@netlab_group.command("down")
@_name_option
def netlab_down(name):
    """Remove a lab, and whatever a killed run of it left (processes, namespaces, links)."""
    check_privileges()
    removed = down(name)
    click.echo(f"netlab {name}: removed {', '.join(removed)}" if removed
               else f"netlab {name}: nothing to remove")


@netlab_group.command("login", context_settings={"ignore_unknown_options": True,
                                                 "allow_interspersed_args": False})
@_name_option
@click.argument("command", nargs=-1, type=click.UNPROCESSED, required=True)
def netlab_login(name, command):
    """Run COMMAND on the lab's login node (the hub), as a user logged in to the cluster:
    with `up --slurm`, Slurm's commands (sbatch, salloc, srun, squeue, scancel) reach the
    lab's Slurm. Exits with COMMAND's status."""
    check_privileges()
    lab = Lab.load(name)
    if lab is None:
        raise CaffeparError(f"netlab: no lab named {name!r} is up")
    from caffepar import netlab_slurm
    env = netlab_slurm.environment(lab) if netlab_slurm.is_up(lab) else dict(os.environ)
    try:
        done = subprocess.run(netlab_slurm.in_hub(lab, command), env=env)
    except FileNotFoundError as error:
        raise CaffeparError(f"netlab login: {error.strerror}: {error.filename}")
    sys.exit(done.returncode)


@netlab_group.command("status")
@_name_option
def netlab_status(name):
    """The lab's nodes, addresses, link rates and the bytes each link has carried."""
    check_privileges()
    lab = Lab.load(name)
    namespaces = lab_namespaces(name)
    if lab is None:
        click.echo(f"netlab {name}: down" + (f" (leftover namespaces: {', '.join(namespaces)}; "
                                            f"caffepar netlab down --name {name})"
                                            if namespaces else ""))
        return
    click.echo(describe(lab, with_counters=True))


@netlab_group.command("link")
@_name_option
@click.argument("node", type=click.IntRange(min=0))
@click.argument("state")
def netlab_link(name, node, state):
    """Change node NODE's link: `down`, `up`, or a new RATE (e.g. cut to 100mbit mid-run)."""
    check_privileges()
    lab = Lab.load(name)
    if lab is None:
        raise CaffeparError(f"netlab: no lab named {name!r} is up")
    if node >= lab.nodes:
        raise click.BadParameter(f"lab {name} has nodes 0..{lab.nodes - 1}", param_hint="NODE")
    if state in ("down", "up"):
        set_link(lab, node, state)
    else:
        bits = parse_rate(state)
        shape(lab, node, bits)
        lab.rates[node] = bits
        with open(os.path.join(lab.folder, "lab.json"), "w", encoding="utf-8") as f:
            json.dump(lab.to_dict(), f)
    click.echo(f"netlab {name}: node{node} link {state}")


@netlab_group.command("run", context_settings={"ignore_unknown_options": True,
                                               "allow_interspersed_args": False})
@_name_option
@_layout_options
@click.option("--threads", type=click.IntRange(min=1), default=1, show_default=True,
              help="BLAS threads per rank.")
@click.option("--mpiexec", default=None,
              help="hydra's mpiexec to launch with (Open MPI's mpirun where mpi4py runs on "
                   "Open MPI).")
@click.argument("command", nargs=-1, type=click.UNPROCESSED, required=True)
def netlab_run(name, nodes, ranks_per_node, link, threads, mpiexec, command):
    """Run `caffepar COMMAND` (train, time, calibrate ...) with a rank per node slot.

    On the lab NAME if it is up (with no layout options), else on a lab made for this run
    and removed after it (also on Ctrl-C or an error)."""
    check_privileges()
    lab = Lab.load(name)
    made = False
    if lab is not None and any(v is not None for v in (nodes, ranks_per_node, link)):
        raise click.UsageError(f"lab {name} is up already: drop --nodes/--ranks-per-node/"
                               f"--link, or use another --name")
    if lab is None:
        lab = up(_lab_from_options(name, nodes, ranks_per_node, link))
        made = True
    previous = signal.signal(signal.SIGTERM, _raise_interrupt) if made else None
    try:
        click.echo(f"netlab {name}: {lab.nodes} nodes x {lab.ranks_per_node} ranks, links "
                   f"{', '.join(format_rate(r) for r in lab.rates)}", err=True)
        status = run_job(lab, command, threads, mpiexec)
    finally:
        if made:
            down(lab.name)
            signal.signal(signal.SIGTERM, previous)
    sys.exit(status)


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


def describe(lab, with_counters=False):
    lines = [f"netlab {lab.name}: {lab.nodes} nodes x {lab.ranks_per_node} ranks per node, "
             f"hub {HUB_ADDRESS} ({lab.hub})"]
    stats = counters(lab) if with_counters else {}
    for node in range(lab.nodes):
        line = (f"  node{node}  {lab.address(node)}  {lab.namespace(node)}  link "
                f"{format_rate(lab.rates[node])}")
        if node in stats:
            sent, received = stats[node]
            line += f"  sent {sent:,} B  received {received:,} B"
        lines.append(line)
    from caffepar import netlab_slurm
    if netlab_slurm.is_up(lab):
        states = netlab_slurm.sinfo(lab)
        lines.append(f"  slurm: slurmctld on the hub, SLURM_CONF={netlab_slurm.conf_path(lab)}; "
                     + (", ".join(f"{n} {s}" for n, s in sorted(states.items()))
                        if states else "slurmctld does not answer"))
    return "\n".join(lines)
