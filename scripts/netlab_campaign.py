#!/usr/bin/env python
"""VGG-16 and AlexNet on the network lab (`caffepar netlab`): DATA, HYBRID and AUTO measured over
shaped links between network namespaces, each beside the cost model's prediction, and the
lab's links calibrated (`caffepar calibrate` inside the lab) at each rate.

    sudo python scripts/netlab_campaign.py [--lock FILE] [--until HH:MM] [--only KIND]

A campaign is a list of pieces in priority order (rate probe, calibrations, one-process
profiles, `caffepar time` runs on the lab); each piece is one command, its result appended to
results/netlab_pieces.csv as soon as it is done (kept with the results, so any checkout
continues where the last run stopped; a piece that failed is retried). A `time` piece stores its
prediction as it is measured: the profiles it came from live in snapshots/netlab/ with the
nets and logs, which a checkout does not have. With --lock, each piece holds that file's exclusive
flock while it runs (a machine shared with other jobs: nothing else timed runs meanwhile); the
CPU others used just before each piece is recorded. Writes results/netlab.csv, netlab.md and
netlab.png from whatever pieces are done, listing those not yet measured.

Prediction of an iteration = compute + communication, no overlap (plain synchronous SGD):
compute from a one-process, one-thread profile of the net at that batch measured here
(`caffepar time --save-profile`); communication from the cost model fitted on the lab's link
at that rate (`results/calibration_netlab_<rate>.json`) for the plan's layers.
"""
import argparse
import csv
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

STATE = ROOT / "snapshots" / "netlab"
RESULTS = ROOT / "results"
PIECES = RESULTS / "netlab_pieces.csv"
LAB = "cpc"
ONE_THREAD = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
FIELDS = ("key", "kind", "net", "mode", "nodes", "ranks_per_node", "rate", "batch", "options",
          "iterations", "iteration_ms", "min_ms", "comm_ms", "comm_mb", "value", "others_busy_pct",
          "status", "when", "predicted_ms", "predicted_comm_ms", "model_parallel")
PLANS = ("DATA", "HYBRID", "AUTO")
NETS = ("vgg16", "alexnet")
PROBE_RATES = ("2gbit", "5gbit", "10gbit", "20gbit", "unshaped")


def model_path(name):
    return ROOT / f"models/{name}/train_val_dummy.prototxt"


# ------------------------------------------------------------------------------ pieces
def piece(kind, **kw):
    kw = {"net": "", "mode": "", "nodes": 2, "ranks_per_node": 1, "rate": "", "batch": 0,
          "options": "", "iterations": 0, **kw}
    kw["kind"] = kind
    kw["key"] = "/".join(str(kw[f]) for f in ("kind", "net", "mode", "nodes", "ranks_per_node",
                                              "rate", "batch", "options"))
    return kw


def campaign(top_rate):
    """Every piece, in the order they are worth measuring."""
    out = [piece("probe", rate=r) for r in PROBE_RATES]
    for rate in ("1gbit", "100mbit", top_rate, "unshaped"):
        iterations = 2 if rate == "100mbit" else 3
        out.append(piece("calibrate", rate=rate))
        for net in NETS:
            for batch in (1, 2, 4):
                if rate == "1gbit":
                    out.append(piece("profile", net=net, batch=batch, nodes=1, iterations=3))
                for mode in PLANS:
                    out.append(piece("time", net=net, mode=mode, rate=rate, batch=batch,
                                     iterations=iterations))
    # P=4: 2 nodes x 2 ranks and 4 nodes x 1 rank at 1 Gbit/s
    for nodes, per in ((2, 2), (4, 1)):
        out.append(piece("calibrate", rate="1gbit", nodes=nodes, ranks_per_node=per))
        for net in NETS:
            for mode in PLANS:
                out.append(piece("time", net=net, mode=mode, rate="1gbit", batch=2,
                                 nodes=nodes, ranks_per_node=per, iterations=3))
    # the paper's Fig. 14-16 sweep on 1 Gbit/s links, P=2
    out.append(piece("fc", rate="1gbit"))
    # the communication options against plain DATA, VGG-16 batch 2 per rank
    for rate in ("1gbit", "100mbit"):
        for opts in ("--overlap", "--merge auto", "--topk 0.01"):
            out.append(piece("time", net="vgg16", mode="DATA", rate=rate, batch=2,
                             options=opts, iterations=3))
    out.append(piece("time", net="vgg16", mode="DATA", rate="1gbit", batch=2, nodes=2,
                     ranks_per_node=2, options="--hierarchical",
                     iterations=3))
    for batch in (8, 16, 32):
        for net in NETS:
            out.append(piece("profile", net=net, batch=batch, nodes=1, iterations=2))
            for mode in PLANS:
                out.append(piece("time", net=net, mode=mode, rate="1gbit", batch=batch,
                                 iterations=2))
    return out


def calibration_file(rate, nodes=2, per=1):
    layout = "" if (nodes, per) == (2, 1) else f"_{nodes}x{per}"
    return RESULTS / f"calibration_netlab_{rate}{layout}.json"


def net_file(name, batch):
    """The net's prototxt at `batch` per rank (kept in the campaign's folder)."""
    from caffepar.graph.passes import with_batch
    from caffepar.proto.text import read_net_text
    from google.protobuf import text_format
    path = STATE / f"{name}_b{batch}.prototxt"
    if not path.exists():
        param, _ = read_net_text(str(model_path(name)))
        path.write_text(text_format.MessageToString(with_batch(param, batch)))
    return path


def lab_run(p, command):
    return [sys.executable, "-m", "caffepar.cli", "netlab", "run", "--name", LAB,
            "--nodes", str(p["nodes"]), "--ranks-per-node", str(p["ranks_per_node"]),
            "--link", p["rate"], "--", *command]


def command(p):
    if p["kind"] == "profile":
        return [sys.executable, "-m", "caffepar.cli", "time", "--model",
                str(net_file(p["net"], p["batch"])), "--iterations", str(p["iterations"]),
                "--save-profile", str(profile_file(p["net"], p["batch"]))]
    if p["kind"] == "calibrate":
        out = calibration_file(p["rate"], p["nodes"], p["ranks_per_node"])
        if out.exists():
            out.unlink()
        return lab_run(p, ["calibrate", "--transport", "tcp", "-o", str(out), "--max-mb", "16",
                           "--repeats", "3"])
    if p["kind"] == "time":
        cmd = ["time", "--model", str(net_file(p["net"], p["batch"])), "--iterations",
               str(p["iterations"]), "--parallel", p["mode"].lower()]
        cal = calibration_file(p["rate"], p["nodes"], p["ranks_per_node"])
        if cal.exists():
            cmd += ["--calibration", str(cal)]
        return lab_run(p, cmd + p["options"].split())
    if p["kind"] == "fc":
        return [sys.executable, str(ROOT / "scripts" / "reproduce_fc_comm.py"), "--transports",
                f"netlab_{p['rate']}", "--ranks", str(p["nodes"]), "--measure-only"]
    raise ValueError(p["kind"])


def profile_file(name, batch):
    return STATE / f"{name}_b{batch}_profile.json"


PROBE = """
import socket, sys, time
n = int(sys.argv[2])
if sys.argv[1] == "serve":
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", 5401)); s.listen(1); c, _ = s.accept(); got = 0
    buf = bytearray(1 << 20)
    while got < n:
        got += c.recv_into(buf)
    c.sendall(b"k")
else:
    for _ in range(100):
        try:
            c = socket.create_connection((sys.argv[3], 5401)); break
        except ConnectionRefusedError:
            time.sleep(0.05)
    buf = b"x" * (1 << 22); t = time.perf_counter()
    for _ in range(n >> 22):
        c.sendall(buf)
    c.recv(1); print(time.perf_counter() - t)
"""


def probe(p):
    """Mbit/s one TCP stream fills from node0 to node1 at `rate` (256 MiB, best of 3)."""
    from caffepar import netlab
    lab = netlab.up(netlab.Lab(LAB, netlab.parse_links(p["rate"], 2)))
    try:
        best = 0.0
        nbytes = 256 * 2 ** 20
        for _ in range(3):
            server = subprocess.Popen(["ip", "netns", "exec", lab.namespace(1), sys.executable,
                                       "-c", PROBE, "serve", str(nbytes)])
            client = subprocess.run(["ip", "netns", "exec", lab.namespace(0), sys.executable,
                                     "-c", PROBE, "send", str(nbytes), str(lab.address(1))],
                                    capture_output=True, text=True, timeout=120)
            server.wait(60)
            best = max(best, nbytes * 8 / float(client.stdout) / 1e6)
        return best
    finally:
        netlab.down(LAB)


def parse_time(out):
    laps = [float(m) for m in re.findall(r"forward-backward time: ([\d.]+) ms", out)]
    comm = re.search(r"Average communication \(\d+ ranks\): ([\d.]+) ms, ([\d.]+) MB", out)
    return {"iteration_ms": round(sum(laps) / len(laps), 1), "min_ms": round(min(laps), 1),
            "comm_ms": round(float(comm.group(1)), 1) if comm else "",
            "comm_mb": round(float(comm.group(2)), 1) if comm else ""}


def run_piece(p):
    from bench_comm_opt import cpu_busy
    row = {f: p.get(f, "") for f in FIELDS}
    busy = cpu_busy(2.0)
    row["others_busy_pct"] = "" if busy is None else round(100 * busy)
    row["when"] = time.strftime("%Y-%m-%d %H:%M")
    env = {**os.environ, **ONE_THREAD}
    if p["kind"] == "probe":
        cmd = [sys.executable, __file__, "--probe", p["rate"]]
    else:
        cmd = command(p)
    started = time.monotonic()
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=STATE,
                          timeout=15 * 60)
    out = done.stdout + done.stderr
    (STATE / "logs").mkdir(exist_ok=True)
    (STATE / "logs" / (p["key"].replace("/", "_").replace(" ", "") + ".log")).write_text(out)
    row["status"] = "ok" if done.returncode == 0 else f"exit {done.returncode}"
    if done.returncode == 0:
        if p["kind"] == "probe":
            row["value"] = round(float(done.stdout.split()[-1]), 1)
        elif p["kind"] == "calibrate":
            from caffepar.parallel.cost import CostModel
            model = CostModel.load(calibration_file(p["rate"], p["nodes"], p["ranks_per_node"]))
            row["value"] = model.fit_for(p["nodes"] * p["ranks_per_node"])["allreduce"][1]
        elif p["kind"] in ("time", "profile"):
            row.update(parse_time(out))
        if p["kind"] == "time":
            pred, pred_comm, splits = predicted(p, read_pieces(), os.cpu_count() or 1)
            if pred is not None:
                row.update(predicted_ms=round(pred, 1), predicted_comm_ms=round(pred_comm, 1),
                           model_parallel=splits)
    print(f"{p['key']}: {row['status']} {row.get('iteration_ms') or row.get('value')} "
          f"({time.monotonic() - started:.0f} s, others busy {row['others_busy_pct']}%)",
          flush=True)
    return row


def read_pieces():
    if not PIECES.exists():
        return {}
    with open(PIECES, newline="") as f:
        return {r["key"]: {f: r.get(f) or "" for f in FIELDS} for r in csv.DictReader(f)}


def rebuild_pieces():
    """The pieces' state from the results a checkout holds, when the state file is missing
    (a campaign measured before it was kept with the results): `time` pieces with their
    predictions from netlab.csv, calibrations from their files, probes from netlab.md's table
    of the links, the Fig. 14-16 sweep from netlab_fc.csv. A profile counts as done where a
    prediction was made from it."""
    from caffepar.parallel.cost import CostModel
    table = RESULTS / "netlab.csv"
    if PIECES.exists() or not table.exists():
        return
    rows = []
    with open(table, newline="") as f:
        for r in csv.DictReader(f):
            opts = "" if r["options"] == "-" else r["options"]
            kw = dict(net=r["net"], nodes=int(r["nodes"]), ranks_per_node=int(r["ranks_per_node"]),
                      batch=int(r["batch"]))
            p = piece("time", mode=r["mode"], rate=r["rate"], options=opts,
                      iterations=int(r["iterations"]), **kw)
            rows.append({**p, "iteration_ms": r["measured_ms"], "min_ms": r["min_ms"],
                         "comm_ms": r["comm_ms"], "comm_mb": r["comm_mb"],
                         "others_busy_pct": r["others_busy_pct"], "status": "ok",
                         "when": r["when"], "predicted_ms": r["predicted_ms"],
                         "predicted_comm_ms": r["predicted_comm_ms"],
                         "model_parallel": r["model_parallel"] if r["predicted_ms"] else ""})
            if r["predicted_ms"]:
                prof = piece("profile", net=r["net"], batch=int(r["batch"]), nodes=1,
                             iterations=2 if int(r["batch"]) >= 8 else 3)
                rows.append({**prof, "status": "ok", "when": r["when"]})
    report = (RESULTS / "netlab.md").read_text() if (RESULTS / "netlab.md").exists() else ""
    for rate in PROBE_RATES:
        m = re.search(rf"^\| {rate} \| ([\d,.]+) \|", report, re.M)
        if m:
            rows.append({**piece("probe", rate=rate), "status": "ok",
                         "value": m.group(1).replace(",", "")})
    for path in sorted(RESULTS.glob("calibration_netlab_*.json")):
        m = re.fullmatch(r"calibration_netlab_(\w+?)(?:_(\d+)x(\d+))?\.json", path.name)
        nodes, per = (int(m.group(2)), int(m.group(3))) if m.group(2) else (2, 1)
        value = CostModel.load(path).fit_for(nodes * per)["allreduce"][1]
        rows.append({**piece("calibrate", rate=m.group(1), nodes=nodes, ranks_per_node=per),
                     "status": "ok", "value": value})
    if (RESULTS / "netlab_fc.csv").exists():
        rows.append({**piece("fc", rate="1gbit"), "status": "ok"})
    seen = set()
    for row in rows:
        if row["key"] not in seen:
            seen.add(row["key"])
            append_piece({f: row.get(f, "") for f in FIELDS})


def append_piece(row):
    new = not PIECES.exists()
    with open(PIECES, "a", newline="") as f:
        w = csv.DictWriter(f, FIELDS)
        if new:
            w.writeheader()
        w.writerow(row)


def top_rate(done):
    """The highest shaped rate one TCP stream between two nodes fills to 90% or more."""
    best = None
    for rate in PROBE_RATES[:-1]:
        row = done.get(piece("probe", rate=rate)["key"])
        if row and row["status"] == "ok":
            from caffepar import netlab
            if float(row["value"]) >= 0.9 * netlab.parse_rate(rate) / 1e6:
                best = rate
    return best or "2gbit"


def past(until, now=None):
    """Whether UTC time `until` (HH:MM) has come, taken as up to 12 hours ahead of `now` (so
    23:50 is before 00:30, and 00:30 past 23:50 only once midnight is crossed)."""
    hours, minutes = map(int, until.split(":"))
    now = time.gmtime() if now is None else now
    ahead = (hours * 60 + minutes - now.tm_hour * 60 - now.tm_min) % (24 * 60)
    return ahead == 0 or ahead > 12 * 60


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lock", help="Hold this file's exclusive flock while measuring, in "
                    "stretches of about 10 minutes.")
    ap.add_argument("--until", help="Start no piece after this UTC time (HH:MM).")
    ap.add_argument("--only", help="Measure only pieces of this kind.")
    ap.add_argument("--report", action="store_true", help="Only write the results.")
    ap.add_argument("--stretch", type=float, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--probe", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.probe:
        print(probe(piece("probe", rate=args.probe)))
        return
    from caffepar.netlab import missing_privileges
    STATE.mkdir(parents=True, exist_ok=True)
    rebuild_pieces()
    if not args.report:
        message = missing_privileges()
        if message:
            sys.exit(message)
        failed = set()
        began = time.monotonic()
        while True:
            done = read_pieces()
            todo = [p for p in campaign(top_rate(done))
                    if (done.get(p["key"]) or {}).get("status") != "ok"
                    and p["key"] not in failed and (not args.only or p["kind"] == args.only)]
            if not todo:
                break
            if args.until and past(args.until):
                print(f"stopping: it is past {args.until} UTC", flush=True)
                break
            if args.lock:
                # hold the lock for a stretch of pieces (<= --stretch minutes), then let
                # the machine's other jobs in
                subprocess.run(["flock", "-x", args.lock, sys.executable, __file__,
                                "--stretch", "10"]
                               + (["--until", args.until] if args.until else [])
                               + (["--only", args.only] if args.only else []))
                if len(todo) == len([p for p in todo if (read_pieces().get(p["key"]) or {})
                                     .get("status") != "ok"]):
                    print("a stretch measured nothing new: stopping", flush=True)
                    break
                continue
            row = run_piece(todo[0])
            append_piece(row)
            if row["status"] != "ok":
                failed.add(row["key"])      # retried by the next run of the script
            if args.stretch and time.monotonic() - began > 60 * args.stretch:
                return
    if args.stretch:
        return
    done = read_pieces()
    write_report(done, campaign(top_rate(done)))


def predicted(p, done, cores):
    """(predicted iteration ms, predicted comm ms, the plan's model-parallel layers) of a
    `time` piece, or Nones without
    its profile or calibration (or for a communication option, which the model does not
    predict here)."""
    from caffepar.parallel.cost import CostModel
    from caffepar.timing import load_profile, profile_compute_ms
    from cluster_plan import predict
    prof = done.get(piece("profile", net=p["net"], batch=p["batch"], nodes=1,
                          iterations=2 if p["batch"] >= 8 else 3)["key"])
    cal = calibration_file(p["rate"], p["nodes"], p["ranks_per_node"])
    if p["options"] or not prof or prof["status"] != "ok" or not cal.exists() \
            or not profile_file(p["net"], p["batch"]).exists():
        return None, None, ""
    ranks = p["nodes"] * p["ranks_per_node"]
    doc = load_profile(profile_file(p["net"], p["batch"]))
    # ranks beyond the cores share them: each rank's compute slows by P / cores
    compute = profile_compute_ms(doc, p["batch"]) * max(1.0, ranks / cores)
    comm, splits = predict(p["net"], p["batch"], ranks, CostModel.load(cal))[p["mode"]]
    return compute + comm, comm, " ".join(splits) or "-"


def result_rows(done, pieces):
    cores = os.cpu_count() or 1
    rows = []
    for p in pieces:
        r = done.get(p["key"])
        if p["kind"] != "time" or not r or r["status"] != "ok":
            continue
        if r.get("predicted_ms"):
            pred, pred_comm = float(r["predicted_ms"]), float(r["predicted_comm_ms"])
            splits = r["model_parallel"]
        else:
            pred, pred_comm, splits = predicted(p, done, cores)
        measured = float(r["iteration_ms"])
        rows.append({"net": p["net"], "mode": p["mode"], "options": p["options"] or "-",
                     "nodes": p["nodes"], "ranks_per_node": p["ranks_per_node"],
                     "np": p["nodes"] * p["ranks_per_node"], "rate": p["rate"],
                     "batch": p["batch"], "iterations": p["iterations"],
                     "model_parallel": splits,
                     "measured_ms": measured, "min_ms": float(r["min_ms"]),
                     "comm_ms": r["comm_ms"], "comm_mb": r["comm_mb"],
                     "predicted_ms": "" if pred is None else round(pred, 1),
                     "predicted_comm_ms": "" if pred_comm is None else round(pred_comm, 1),
                     "error_pct": "" if pred is None else round(100 * (pred - measured) /
                                                                measured, 1),
                     "others_busy_pct": r["others_busy_pct"], "when": r["when"]})
    return rows


def write_report(done, pieces):
    """results/netlab.csv, .md and .png from the pieces done."""
    from cpuinfo import cpu_name
    from caffepar import netlab
    rows = result_rows(done, pieces)
    RESULTS.mkdir(exist_ok=True)
    if rows:
        with open(RESULTS / "netlab.csv", "w", newline="") as f:
            w = csv.DictWriter(f, list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    get = {(r["net"], r["mode"], r["options"], r["nodes"], r["ranks_per_node"], r["rate"],
            r["batch"]): r for r in rows}
    busy = [int(r["others_busy_pct"]) for r in done.values()
            if r["status"] == "ok" and r["kind"] != "probe"
            and r["others_busy_pct"] not in ("", None)]
    md = ["# caffepar on the network lab: measured beside the cost model", "",
          "Produced by `python scripts/netlab_campaign.py --report` from the pieces "
          "`scripts/netlab_campaign.py` measured (run as root; it resumes where it stopped). "
          f"CPU: {cpu_name()}, {os.cpu_count()} cores for every node and "
          "rank together "
          "(the lab's nodes are network namespaces of one machine). Each piece held an "
          "exclusive lock against the machine's other timed jobs; the CPU others used in "
          "the 2 s before each timed piece "
          + (f"was {min(busy)}-{max(busy)}% (median {sorted(busy)[len(busy) // 2]}%)"
             if busy else "was not recorded") + ".", "",
          "Lab: `caffepar netlab` - each node a network namespace with one veth link to a "
          "bridge, shaped by tc tbf on both ends (both directions); ranks of a node on MPICH "
          "shared memory, between nodes UCX over TCP only (`UCX_TLS=tcp,self`) through the "
          "link. One BLAS thread per rank. Iteration = `caffepar time` (mean of its timed "
          "iterations, after an untimed warm-up pass). Predicted = compute (one-process, "
          "one-thread profile of the net at that batch, measured here; x P/cores where ranks "
          "outnumber cores) + communication (the cost model fitted on the lab's link at that "
          "rate), added without overlap.", ""]
    md += findings(get, rows)
    # ---- the links
    md += ["## The links", "", "One TCP stream, node0 to node1, 256 MiB (best of 3):", "",
           "| link | Mbit/s filled | of the rate |", "|---|---|---|"]
    for rate in PROBE_RATES:
        r = done.get(piece("probe", rate=rate)["key"])
        if r and r["status"] == "ok":
            bits = netlab.parse_rate(rate)
            share = f"{100 * float(r['value']) * 1e6 / bits:.0f}%" if bits else "-"
            md.append(f"| {rate} | {float(r['value']):,.0f} | {share} |")
    top = top_rate(done)
    md += ["", f"Highest shaped rate one stream fills to 90% or more: **{top}** (the lab's "
           "fastest shaped link below).", "",
           "## Calibration on the lab (`caffepar netlab run -- calibrate`)", "",
           "Allreduce fit at P=2 (2 nodes x 1 rank): beta is seconds per byte each rank sends "
           "(2 (P-1)/P n), so at P=2 the link alone would give beta = 8 / rate.", "",
           "| link | alpha us | beta ns/B | MB/s | link's 8/rate ns/B | fitted / link beta |",
           "|---|---|---|---|---|---|"]
    from caffepar.parallel.cost import CostModel
    for rate in ("100mbit", "1gbit", top, "unshaped"):
        cal = calibration_file(rate)
        if not cal.exists():
            continue
        alpha, beta = CostModel.load(cal).fit_for(2)["allreduce"]
        bits = netlab.parse_rate(rate)
        link = f"{8 / bits * 1e9:.3f}" if bits else "-"
        ratio = f"**{beta / (8 / bits):.2f}**" if bits else "-"
        md.append(f"| {rate} | {alpha * 1e6:.0f} | {beta * 1e9:.3f} | {1 / beta / 1e6:.0f} | "
                  f"{link} | {ratio} |")
    # ---- the plans
    def cell(key):
        r = get.get(key)
        if not r:
            return "-"
        pred = f" ({r['predicted_ms']:.0f}, {r['error_pct']:+.0f}%)" \
            if r["predicted_ms"] != "" else ""
        split = f" [{r['model_parallel']}]" if r["mode"] == "AUTO" and r["model_parallel"] \
            else ""
        loud = " †" if r["others_busy_pct"] not in ("", None) and \
            int(r["others_busy_pct"]) >= 20 else ""
        return f"{r['measured_ms']:.0f}{loud}{pred}{split}"

    for nodes, per in ((2, 1), (2, 2), (4, 1)):
        keys = sorted({(r["rate"], r["batch"]) for r in rows
                       if (r["nodes"], r["ranks_per_node"]) == (nodes, per)
                       and r["options"] == "-"},
                      key=lambda k: (netlab.parse_rate(k[0]) or 1e15, k[1]))
        if not keys:
            continue
        md += ["", f"## DATA, HYBRID, AUTO: P={nodes * per} ({nodes} nodes x {per} rank"
               f"{'s' if per > 1 else ''})", "",
               "Iteration ms measured (predicted, prediction's error) [AUTO's model-parallel "
               "layers; HYBRID's are fc6 fc7]. HYBRID/DATA: measured ratio; AUTO vs best: "
               "AUTO's iteration over the better of DATA and HYBRID. †: other processes "
               "used 20% or more of the CPU just before the run (they did not hold the "
               "lock), so its compute may be slower.", ""]
        for net in NETS:
            md += [f"**{net}**", "",
                   "| link | batch/rank | DATA | HYBRID | AUTO | HYBRID/DATA | AUTO vs best |",
                   "|---|---|---|---|---|---|---|"]
            for rate, batch in keys:
                k = lambda mode: (net, mode, "-", nodes, per, rate, batch)
                d, h, a = (get.get(k(m)) for m in PLANS)
                ratio = f"{h['measured_ms'] / d['measured_ms']:.2f}" if d and h else "-"
                vs = f"{a['measured_ms'] / min(d['measured_ms'], h['measured_ms']):.2f}" \
                    if d and h and a else "-"
                md.append(f"| {rate} | {batch} | {cell(k('DATA'))} | {cell(k('HYBRID'))} | "
                          f"{cell(k('AUTO'))} | {ratio} | {vs} |")
            md.append("")
    md += fc_section()
    opts = [r for r in rows if r["options"] != "-"]
    if opts:
        md += ["## Communication options against plain DATA (VGG-16, batch 2 per rank)", "",
               "Speedup = plain DATA's iteration / the option's, same layout and link, "
               "measured in the same campaign. Top-k runs under `caffepar time`, without "
               "momentum correction (an option of `train`: it changes the update, not what "
               "travels). The 2 cores bound these figures where the option needs CPU beside "
               "the ranks' compute: overlap's progress thread and top-k's selection take it "
               "from the computation, as on a node whose cores are all busy; the hierarchical "
               "run has 4 ranks on 2 cores.", "",
               "| link | layout | option | iteration ms | DATA ms | speedup |",
               "|---|---|---|---|---|---|"]
        for r in opts:
            base = get.get((r["net"], "DATA", "-", r["nodes"], r["ranks_per_node"], r["rate"],
                            r["batch"]))
            md.append(f"| {r['rate']} | {r['nodes']}x{r['ranks_per_node']} | {r['options']} | "
                      f"{r['measured_ms']:.0f} | {base['measured_ms']:.0f} | "
                      f"{base['measured_ms'] / r['measured_ms']:.2f} |" if base else
                      f"| {r['rate']} | {r['nodes']}x{r['ranks_per_node']} | {r['options']} | "
                      f"{r['measured_ms']:.0f} | - | - |")
        md.append("")
        for rate in sorted({r["rate"] for r in opts}, key=lambda x: netlab.parse_rate(x) or 0):
            mine = [r for r in opts if r["rate"] == rate and r["ranks_per_node"] == 1]
            base = get.get(("vgg16", "DATA", "-", 2, 1, rate, 2))
            if mine and base:
                best = min(mine, key=lambda r: r["measured_ms"])
                slower = [r["options"] for r in mine if r["measured_ms"] > base["measured_ms"]]
                md.append(f"- {rate}, 2 nodes x 1 rank: fastest `{best['options']}` "
                          f"({base['measured_ms'] / best['measured_ms']:.2f}x DATA)"
                          + (f"; slower than plain DATA: {', '.join(slower)}" if slower
                             else "") + ".")
        md.append("")
    from netlab_topk_accuracy import topk_section
    md += topk_section()
    missing = [p for p in pieces if (done.get(p["key"]) or {}).get("status") != "ok"]
    md += ["## Not yet measured", ""]
    if missing:
        md += [f"{len(missing)} of {len(pieces)} pieces (in the order the script measures "
               "them); `sudo python scripts/netlab_campaign.py` resumes with them:", ""]
        md += [f"- {p['kind']} {p['net']} {p['mode']} {p['options']} "
               f"{p['nodes']}x{p['ranks_per_node']} {p['rate']} batch {p['batch']}".replace(
                   "  ", " ") for p in missing]
    else:
        md.append("Nothing: every piece of the campaign is measured.")
    (RESULTS / "netlab.md").write_text("\n".join(md) + "\n")
    if rows:
        plot(rows)
    print(f"{len(pieces) - len(missing)} of {len(pieces)} pieces done; wrote results/netlab.*")


def fc_section(rate="1gbit"):
    """The paper's Fig. 14-16 on the lab (P=2) beside shm and TCP loopback (results/fc_comm.csv)
    and the paper's winners; AUTO's choice from the lab's calibration."""
    import reproduce_fc_comm as fc
    from caffepar.parallel.cost import CostModel
    t = f"netlab_{rate}"
    sweep, kept = fc.STATE / f"{t}_p2.csv", RESULTS / "netlab_fc.csv"
    if sweep.exists():
        kept.write_text(sweep.read_text())      # the sweep's rows, kept with the results
    elif not kept.exists():
        return []
    with open(kept, newline="") as f:
        rows = list(csv.DictReader(f))
    for r in rows:
        r["np"], r["batch"], r["comm_ms"] = int(r["np"]), int(r["batch"]), float(r["comm_ms"])
    rows += fc.read_rows(["shm", "tcp"], [2])
    models = {t: CostModel.load(calibration_file(rate))} if calibration_file(rate).exists() \
        else {}
    cells = {(c["layer"], c["transport"], c["batch"]): c for c in fc.summarize(rows, models)}
    out = [f"## VGG-16's fc6, fc7, fc8: DATA vs MODEL communication on {rate} links (Fig. "
           "14-16), P=2", "",
           "Communication ms per iteration of the layer alone (`scripts/reproduce_fc_comm.py "
           f"--transports {t} --ranks 2`: slowest rank, median of 5 after 2 warm-ups; rows "
           "in results/netlab_fc.csv), each "
           "cell DATA / MODEL and the faster; beside the same sweep over shared memory and "
           "TCP loopback (results/fc_comm.csv) and the paper's winner. AUTO: the mode the "
           "cost model fitted on the lab's link picks.", "",
           "| layer | batch | lab DATA / MODEL ms | lab | AUTO | paper | shm | tcp loopback |",
           "|---|---|---|---|---|---|---|---|"]
    agree = auto = n = 0
    for layer in fc.LAYERS:
        for batch in fc.BATCHES:
            c = cells.get((layer, t, batch))
            if not c:
                continue
            n += 1
            agree += c["measured_winner"] == c["paper_winner"]
            auto += c.get("auto_choice") == c["measured_winner"]
            other = {tr: (cells.get((layer, tr, batch)) or {}).get("measured_winner", "-")
                     for tr in ("shm", "tcp")}
            out.append(f"| {layer} | {batch} | {c['data_ms']:.1f} / {c['model_ms']:.1f} | "
                       f"{c['measured_winner']} | {c.get('auto_choice', '-')} | "
                       f"{c['paper_winner']} | {other['shm']} | {other['tcp']} |")
    out += ["", f"The lab's winner agrees with the paper's in {agree} of {n} cells"
            + (f"; AUTO picks the lab's faster mode in {auto} of {n}." if models else "."), ""]
    return out


def findings(get, rows):
    """The issue's goals, checked on what is measured."""
    out = ["## What it shows", ""]
    ratios = []
    for batch in (1, 2, 4):
        d = get.get(("vgg16", "DATA", "-", 2, 1, "1gbit", batch))
        h = get.get(("vgg16", "HYBRID", "-", 2, 1, "1gbit", batch))
        if d and h:
            ratios.append((batch, h["measured_ms"] / d["measured_ms"], h, d))
    if ratios:
        met = all(r <= 0.5 for _b, r, _h, _d in ratios)
        out.append("- Goal HYBRID <= 0.5x DATA, VGG-16, P=2 (2 nodes x 1 rank), 1 Gbit/s, "
                   "batch <= 4 per rank, measured side by side in one campaign: "
                   + ", ".join(f"batch {b}: {h['measured_ms']:.0f} / {d['measured_ms']:.0f} ms"
                               f" = **{r:.2f}x**" for b, r, h, d in ratios)
                   + (" - met." if met else " - NOT met at every batch."))
    cells = {}
    for r in rows:
        if r["options"] == "-":
            cells.setdefault((r["net"], r["nodes"], r["ranks_per_node"], r["rate"],
                              r["batch"]), {})[r["mode"]] = r["measured_ms"]
    full = {k: v for k, v in cells.items() if len(v) == 3}
    if full:
        worst = max(full.items(), key=lambda kv: kv[1]["AUTO"] / min(kv[1]["DATA"],
                                                                     kv[1]["HYBRID"]))
        over = [k for k, v in full.items() if v["AUTO"] > 1.05 * min(v["DATA"], v["HYBRID"])]
        ratio = worst[1]["AUTO"] / min(worst[1]["DATA"], worst[1]["HYBRID"])
        out.append(f"- Goal AUTO never more than 5% slower than the better of DATA and HYBRID: "
                   f"{len(full) - len(over)} of {len(full)} measured cells; the worst "
                   f"{ratio:.2f}x ({worst[0][0]}, {worst[0][1]}x{worst[0][2]}, {worst[0][3]}, "
                   f"batch {worst[0][4]})"
                   + ("" if not over else "; over 5%: " + ", ".join(
                       f"{k[0]} {k[3]} batch {k[4]} ({k[1]}x{k[2]})" for k in over)) + ".")
    errs = [abs(r["error_pct"]) for r in rows if r["error_pct"] != ""]
    if errs:
        errs.sort()
        out.append(f"- The cost model's prediction of the iteration: median absolute error "
                   f"{errs[len(errs) // 2]:.0f}%, largest {errs[-1]:.0f}% over {len(errs)} "
                   "runs (per row in the tables below).")
    return out + [""]


def plot(rows):
    from figures import pyplot
    plt = pyplot()
    if plt is None:
        return
    from caffepar import netlab
    rates = sorted({r["rate"] for r in rows if (r["nodes"], r["ranks_per_node"]) == (2, 1)},
                   key=lambda x: netlab.parse_rate(x) or 1e15)
    fig, axes = plt.subplots(len(NETS), max(1, len(rates)), figsize=(4 * max(1, len(rates)), 7),
                             squeeze=False)
    for i, net in enumerate(NETS):
        for j, rate in enumerate(rates):
            ax = axes[i][j]
            for mode, color in zip(PLANS, ("tab:red", "tab:blue", "tab:green")):
                pts = sorted((r["batch"], r["measured_ms"], r["predicted_ms"]) for r in rows
                             if r["net"] == net and r["rate"] == rate and r["mode"] == mode
                             and r["options"] == "-" and (r["nodes"], r["ranks_per_node"])
                             == (2, 1))
                if not pts:
                    continue
                ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color=color,
                        label=f"{mode} measured")
                pred = [(p[0], p[2]) for p in pts if p[2] != ""]
                if pred:
                    ax.plot(*zip(*pred), "x--", color=color, alpha=0.7,
                            label=f"{mode} predicted")
            ax.set_title(f"{net}, P=2 (2 nodes), {rate}", fontsize=9)
            ax.set_xlabel("batch per rank")
            ax.set_ylabel("iteration ms")
            ax.set_xscale("log", base=2)
            ax.set_ylim(bottom=0)
            if i == 0 and j == 0:
                ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(RESULTS / "netlab.png", dpi=90)


if __name__ == "__main__":
    main()
