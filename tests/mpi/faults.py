"""A pass-through Python layer that injects faults into one rank of a job (tests/test_jobs.py).

param_str is JSON: {"sleep": seconds per forward, "pids": folder, "rank": r (or "all"), "at": forward
number, "do": "hang" | "exit0" | "sys.exit" | "memory" | "raise" | "nan" | "slow" |
"gil" (sleeps `seconds` in C holding the GIL) | "segv" (reads address 0: a real segmentation
fault)}. With "pids", every rank writes
`rank<r>.pid` ("pid manager-pid") there at setup, so a test can kill a rank or its process manager
(the rank's parent, or its supervising parent's parent), and a rank that hangs writes
`rank<r>.hangs` there first.
"""
import ctypes
import json
import os
import sys
import time

import numpy as np

import caffe


def this_rank():
    for var in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK"):
        if var in os.environ:
            return int(os.environ[var])
    return 0


def process_manager():
    """The process manager's process that started this rank: its parent, or the parent of the
    parent that supervises it (caffepar/parallel/supervise.py)."""
    parent = os.getppid()
    if os.environ.get("CAFFEPAR_RANK_PARENT") == str(parent):
        with open(f"/proc/{parent}/stat") as f:
            return int(f.read().rpartition(")")[2].split()[1])
    return parent


class Fault(caffe.Layer):
    def setup(self, bottom, top):
        self.conf = json.loads(self.param_str or "{}")
        self.rank = this_rank()
        self.calls = 0
        folder = self.conf.get("pids")
        if folder:
            tmp = os.path.join(folder, f".rank{self.rank}.pid")
            with open(tmp, "w") as f:
                f.write(f"{os.getpid()} {process_manager()}\n")
            os.replace(tmp, os.path.join(folder, f"rank{self.rank}.pid"))

    def reshape(self, bottom, top):
        top[0].reshape(*bottom[0].data.shape)

    def forward(self, bottom, top):
        self.calls += 1
        time.sleep(self.conf.get("sleep", 0))
        if self.conf.get("rank") in (self.rank, "all") and self.calls == self.conf.get("at"):
            what = self.conf["do"]
            if what == "hang":
                if self.conf.get("pids"):       # for a test to wait on, not a guessed time
                    open(os.path.join(self.conf["pids"], f"rank{self.rank}.hangs"), "w").close()
                time.sleep(3600)
            elif what == "slow":
                time.sleep(self.conf.get("seconds", 1))
            elif what == "exit0":
                os._exit(0)
            elif what == "sys.exit":
                sys.exit(0)
            elif what == "memory":
                raise MemoryError()
            elif what == "raise":
                raise ValueError("injected")
            elif what == "segv":
                ctypes.string_at(0)
            elif what == "gil":
                ctypes.PyDLL(None).sleep(int(self.conf.get("seconds", 3600)))
        top[0].data[...] = bottom[0].data
        if self.rank == self.conf.get("rank") and self.conf.get("do") == "nan" and \
                self.calls >= self.conf.get("at"):
            top[0].data[...] = np.nan

    def backward(self, top, propagate_down, bottom):
        if propagate_down[0]:
            bottom[0].diff[...] = top[0].diff
