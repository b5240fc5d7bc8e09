"""The compiled kernels keep their register tiles in registers on every instruction set they are
built for: compiled (not run) for AVX2 (haswell) and AVX-512 (skylake-avx512), the hot kernels'
innermost loops hold no vector load or store addressed from the stack, and the whole functions
few. A tile wider than the target's registers (64-byte vectors on AVX2) or with more live
vectors than it has spills to the stack, which this finds in the disassembly."""
import contextlib
import os
import re
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

import pytest

from caffepar.nn import native

HOT = ("conv_direct_forward", "conv_direct_dw", "conv_to_lanes", "conv_from_lanes",
       "conv_rows_forward", "conv_rows_dw",
       "max_pool_forward", "max_pool_backward", "ave_pool_forward", "ave_pool_backward",
       "ip_forward", "ipw_forward", "ipw_backward_data", "ipw_backward_weights", "lrn_forward",
       "lrn_backward", "wino_input", "wino_output", "wino_output_adjoint")
TILED = ("conv_direct_forward", "conv_direct_dw")
# Tiles in static functions of their own (dw's whole-row tiles, one function per vector
# count, in AVX-512 builds), named by prefix: the compiler may suffix a specialised copy
# (.constprop.0).
TILED_PREFIXES = ("dw_whole_",)
# Moves of one scalar, broadcasts and conversions: spilled loop counters and addresses, not tiles.
SCALAR = re.compile(r"v?(mov[dq]|movs[sd]|p?broadcast\w*|movhp\w|movlp\w|pinsr\w|pextr\w|"
                    r"extractps|insertps|cvt\w*|u?comis[sd]|[a-z]+s[sd])\s")
JUMP = re.compile(r"j\w+\s+([0-9a-f]+)\s")


def functions(obj):
    """{name: [(address, instruction)]} from objdump."""
    out = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(obj)], capture_output=True,
                         text=True, check=True).stdout
    found, fn = {}, None
    for line in out.splitlines():
        m = re.match(r"^[0-9a-f]+ <(.+)>:", line)
        if m:
            fn = found.setdefault(m.group(1), [])
            continue
        m = re.match(r"^\s*([0-9a-f]+):\s+(.*)$", line)
        if m and fn is not None:
            fn.append((int(m.group(1), 16), m.group(2)))
    return found


def on_stack(ins):
    """A vector load, store or operand addressed from %rsp/%rbp."""
    return bool(re.search(r"\(%r[sb]p", ins) and re.search(r"%[xyz]mm", ins)
                and not SCALAR.match(ins))


def stack_references(fn):
    """(in innermost loops, in all) stack vector references of one function. A loop is a
    backward jump and its target; innermost: no other backward jump inside it."""
    jumps = [(int(m.group(1), 16), a) for a, ins in fn
             for m in [JUMP.match(ins + " ")] if m and int(m.group(1), 16) <= a]
    inner = [(t, b) for t, b in jumps if not any(t <= t2 and b2 < b and (t2, b2) != (t, b)
                                                  and b2 > t for t2, b2 in jumps)]
    refs = [a for a, ins in fn if on_stack(ins)]
    return sum(any(t <= a <= b for t, b in inner) for a in refs), len(refs)


MARCHES = ("haswell", "skylake-avx512")


_builds = {}     # march: (object file, its compiler process), from start_builds()


def start_builds():
    """Start compiling the float kernels for each of MARCHES, side by side, at the lowest CPU
    priority. conftest starts them as the session begins (the two take some 70 s of CPU, and
    the suite before this file seldom keeps both cores busy); the fixture then waits for them."""
    if _builds or not shutil.which("objdump") or not shutil.which(native.compiler()):
        return
    folder = Path(tempfile.mkdtemp(prefix="caffepar-isa-"))
    flags = [f for f in native.FLAGS if f not in ("-march=native", "-shared")]
    for m in MARCHES:
        path = folder / f"{m}.o"
        with open(path.with_suffix(".log"), "w") as log:
            _builds[m] = path, subprocess.Popen(
                [native.compiler(), *flags, f"-march={m}", "-DONLY_F32", "-c", "-o", str(path),
                 str(native.SOURCES / "kernels.c")], stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True, preexec_fn=lambda: os.nice(19))


def stop_builds():
    """End the compilers still running (the session ends) and remove their folder."""
    for path, job in _builds.values():
        if job.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(job.pid, signal.SIGKILL)
        job.wait()
        shutil.rmtree(path.parent, ignore_errors=True)
    _builds.clear()


@pytest.fixture(scope="module")
def objects():
    """{march: object file, or why it could not be built}."""
    start_builds()          # not started yet: this file's tests alone
    if not _builds:
        pytest.skip("needs a C compiler and objdump")
    for _path, job in _builds.values():     # needed now: back to this process's priority
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PGRP, job.pid, os.getpriority(os.PRIO_PROCESS, 0))
    return {m: path if job.wait() == 0 else path.with_suffix(".log").read_text()[:200]
            for m, (path, job) in _builds.items()}


@pytest.mark.parametrize("march", MARCHES)
def test_hot_kernels_keep_tiles_in_registers(objects, march):
    if isinstance(objects[march], str):
        pytest.skip(f"{native.compiler()} cannot build for {march}: {objects[march]}")
    found = functions(objects[march])
    counts = {}
    for name in HOT:
        assert f"{name}_f32" in found, name
        counts[name] = stack_references(found[f"{name}_f32"])
    split = {name: fn for name, fn in found.items()
             if name.startswith(TILED_PREFIXES) and "_f32" in name}
    assert split or march == "haswell", TILED_PREFIXES     # only AVX-512 builds use them
    counts.update((name, stack_references(fn)) for name, fn in split.items())
    # The previous 64-byte tiles on AVX2: 5160 in the forward kernel's innermost loops (9217
    # in all), 5768 in dw's; AVX-512's forward kernel had 604 outside its loops.
    # The direct convolution's tiles: none at all in their innermost loops (the AVX2 forward
    # kernel had 8 before its weight vectors were held in registers).
    spilling = {name: c for name, c in counts.items()
                if c[0] > (0 if name in TILED or name in split else 16) or c[1] > 256}
    assert not spilling, f"stack vector references (innermost loops, all): {spilling}"


def test_stack_references_found():
    """The counter itself: a loop that reloads a vector from the stack counts once inside."""
    fn = [(0, "vmovaps %zmm0,0x40(%rsp)"), (4, "vfmadd231ps 0x40(%rsp),%zmm1,%zmm2"),
          (8, "vmovq  %xmm3,0x8(%rsp)"), (12, "jne    4 <f+0x4>"),
          (16, "vmovups %ymm1,(%rdi)")]
    assert stack_references(fn) == (1, 2)
