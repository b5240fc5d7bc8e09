"""The layers' GEMM entry point against NumPy, for every BLAS it can bind, and how layers
share the cores."""
import os
import signal
import time

import numpy as np
import pytest

from caffepar.nn import blas

LOADERS = {"numpy-openblas": blas._numpy_openblas, "scipy": blas._scipy_blas}


@pytest.mark.parametrize("loader", sorted(LOADERS))
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_gemm_views(loader, dtype, monkeypatch):
    table, _ = LOADERS[loader]()
    if not table:
        pytest.skip(f"{loader} BLAS not found in this install")
    monkeypatch.setattr(blas, "_BLAS", table)
    rng = np.random.default_rng(0)
    tol = 1e-5 if dtype == np.float32 else 1e-12
    big = rng.standard_normal((40, 50)).astype(dtype)
    a = big[3:20, 5:30]            # strided rows: leading dimension 50
    b = rng.standard_normal((25, 33)).astype(dtype)
    c = np.zeros((30, 40), dtype)
    out = c[2:19, 1:34]
    blas.gemm_views(a, b, out)
    np.testing.assert_allclose(out, a @ b, rtol=tol, atol=tol * 10)
    before = out.copy()
    blas.gemm_views(a.T.copy(), b.T.copy(), out, trans_a=True, trans_b=True, beta=1.0)
    np.testing.assert_allclose(out, before + (a @ b), rtol=tol, atol=tol * 10)
    assert not c[:2].any() and not c[19:].any() and not c[:, :1].any()
    w = rng.standard_normal((33, 25)).astype(dtype)
    y = np.empty((17, 33), dtype)
    blas.gemm(a, w.T, y)
    np.testing.assert_allclose(y, a @ w.T, rtol=tol, atol=tol * 10)


def test_found_a_blas():
    assert blas._BLAS, "no BLAS bound: every GEMM would fall back to numpy.matmul"


def test_shape_mismatch_is_an_error():
    a, b = np.ones((3, 4), np.float32), np.ones((4, 5), np.float32)
    with pytest.raises(ValueError, match="cannot fill 3x6"):
        blas.gemm_views(a, b, np.empty((3, 6), np.float32))
    with pytest.raises(ValueError):
        blas.gemm_views(a, b, np.empty((3, 5), np.float32), trans_a=True)


IDLE_AFTER_GEMM = """
import json, resource, time
{imports}
from caffepar.nn import blas

def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime

rng = np.random.default_rng(0)
a = rng.standard_normal((512, 300)).astype(np.float32)
w = rng.standard_normal((400, 300)).astype(np.float32)
y = np.empty((512, 400), np.float32)
blas.gemm(a, w.T, y)
start = cpu()
time.sleep(0.15)
idle = cpu() - start
err = float(np.abs(y - a.astype(np.float64) @ w.T.astype(np.float64)).max())
print(json.dumps({{"idle": idle, "threads": blas.blas_threads(), "err": err}}))
"""


def idle_after_gemm(numpy_first, **env):
    """CPU seconds a process used in a 0.15 s sleep after a threaded GEMM through blas.gemm,
    its BLAS thread count and the GEMM's largest error against NumPy in float64."""
    import json
    import subprocess
    import sys
    imports = "import numpy as np\nimport caffepar"
    if not numpy_first:
        imports = "import caffepar\nimport numpy as np"
    drop = ("OPENBLAS_THREAD_TIMEOUT", "OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS",
            "MKL_NUM_THREADS", "OPENBLAS_CORETYPE", "PMI_SIZE") + blas._threads._LOCAL_RANK_VARS
    env = {**{k: v for k, v in os.environ.items() if k not in drop}, **env}
    out = subprocess.run([sys.executable, "-c", IDLE_AFTER_GEMM.format(imports=imports)],
                         env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout)


@pytest.mark.parametrize("numpy_first", [False, True], ids=["caffepar-first", "numpy-first"])
def test_idle_blas_workers_sleep(numpy_first):
    """After a GEMM, OpenBLAS's worker threads must not spin on the cores the layers' own
    threads, their NumPy work and the data threads need: caffepar sets OPENBLAS_THREAD_TIMEOUT
    before NumPy loads OpenBLAS, or makes a NumPy imported first restart its pool with it.
    Spinning workers use about the whole sleep. The GEMM's result and the thread count stay."""
    if blas._THREADS is None:
        pytest.skip("NumPy's OpenBLAS is not the BLAS here")
    got = idle_after_gemm(numpy_first, OPENBLAS_NUM_THREADS="2")
    assert got["idle"] < 0.3 * 0.15, f"BLAS workers used {got['idle']:.3f} s of CPU while idle"
    assert got["threads"] == 2
    assert got["err"] < 1e-3


def test_openblas_environment_keeps_the_users_choices(monkeypatch):
    """Only variables the user left unset are set (and so only those can be missed)."""
    t = blas._threads
    coretype = t.openblas_coretype()
    env = {"OPENBLAS_THREAD_TIMEOUT": "30", "MPI_LOCALNRANKS": "2"}
    monkeypatch.setattr(os, "environ", env)
    n = str(t.threads_per_rank(2))
    assert t.set_openblas_environment() == {"OPENBLAS_NUM_THREADS": n,
                                            **({"OPENBLAS_CORETYPE": coretype} if coretype else {})}
    assert env["OPENBLAS_THREAD_TIMEOUT"] == "30" and env["OMP_NUM_THREADS"] == n
    env = {"OMP_NUM_THREADS": "3", "MPI_LOCALNRANKS": "2", "OPENBLAS_CORETYPE": "Haswell"}
    monkeypatch.setattr(os, "environ", env)
    assert t.set_openblas_environment() == {"OPENBLAS_THREAD_TIMEOUT": "4"}
    assert "OPENBLAS_NUM_THREADS" not in env and env["OPENBLAS_CORETYPE"] == "Haswell"


def test_rank_threads_set_after_numpy():
    """Ranks sharing a node split its cores among their BLAS threads even when NumPy loaded
    OpenBLAS before caffepar could set OPENBLAS_NUM_THREADS."""
    if blas._THREADS is None:
        pytest.skip("NumPy's OpenBLAS is not the BLAS here")
    got = idle_after_gemm(True, MPI_LOCALNRANKS="2")
    assert got["threads"] == blas._threads.threads_per_rank(2)
    assert got["err"] < 1e-3


class FakeOpenBLAS:
    """The entry points _catch_up uses, recording calls."""

    def __init__(self, corename=b"SkylakeX", restart=True):
        self.calls = []
        if restart:
            self.openblas_read_env = lambda: self.calls.append("read_env")
            self.blas_thread_shutdown_ = lambda: self.calls.append("shutdown")
        self.scipy_openblas_get_corename64_ = lambda: corename


def test_catch_up_applies_or_warns(caplog):
    """What OpenBLAS missed is applied through its entry points; what cannot be (kernels
    chosen at load, a library without the restart) is one warning, and only when it matters."""
    set_to = []
    threads = (lambda: 2, set_to.append)
    lib = FakeOpenBLAS()
    with caplog.at_level("WARNING", logger="caffepar"):
        blas._catch_up(lib, "_64_", threads, {"OPENBLAS_THREAD_TIMEOUT": "4",
                                              "OPENBLAS_NUM_THREADS": "1",
                                              "OPENBLAS_CORETYPE": "SkylakeX"})
        assert lib.calls == ["read_env", "shutdown"] and set_to == [1]
        assert not caplog.records
        blas._catch_up(FakeOpenBLAS(), "_64_", threads, {})
        assert set_to == [1] and not caplog.records
        blas._catch_up(FakeOpenBLAS(b"Haswell", restart=False), "_64_", threads,
                       {"OPENBLAS_THREAD_TIMEOUT": "4", "OPENBLAS_CORETYPE": "SkylakeX"})
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2
    assert "OPENBLAS_THREAD_TIMEOUT=4" in messages[0]
    assert "runs Haswell kernels, not SkylakeX" in messages[1]


def test_missed_settings_only_for_a_blas_loaded_before(monkeypatch, tmp_path):
    """Settings count as missed for the library mapped before caffepar set them, not for one
    loaded after; without the process's mappings, NumPy imported before stands for it."""
    t = blas._threads
    maps = tmp_path / "maps"
    maps.write_text("7f00-7f10 r-xp 00000000 08:01 42   /x/numpy.libs/libscipy_openblas64_.so\n"
                    "7f20-7f30 r--p 00000000 00:00 0\n")
    monkeypatch.setattr(t, "_LOADED_BEFORE", t.loaded_openblas(str(maps)))
    monkeypatch.setattr(t, "_SET", {"OPENBLAS_THREAD_TIMEOUT": "4"})
    assert t.missed_settings("/x/numpy.libs/libscipy_openblas64_.so") == t._SET
    assert t.missed_settings("/y/libscipy_openblas64_.so") == {}
    monkeypatch.setattr(t, "_LOADED_BEFORE", t.loaded_openblas(str(tmp_path / "none")))
    monkeypatch.setattr(t, "_NUMPY_BEFORE", True)
    assert t.missed_settings("/y/libscipy_openblas64_.so") == t._SET


def test_single_threaded_blas_nests_and_restores():
    """Work split over Python threads runs single-threaded GEMMs; nested or concurrent users
    share one saved count, and the outermost exit restores it."""
    if blas._THREADS is None:
        pytest.skip("this BLAS's thread count cannot be set")
    get = blas._THREADS[0]
    before = get()
    with blas.single_threaded_blas():
        assert get() == 1 and blas.blas_threads() == before
        with blas.single_threaded_blas():
            assert get() == 1
        assert get() == 1
    assert get() == before == blas.blas_threads()


def test_no_thread_control_means_no_split(monkeypatch):
    monkeypatch.setattr(blas, "_THREADS", None)
    assert blas.blas_threads() == 1
    with blas.single_threaded_blas():
        pass
    assert blas.run_parts(sum, [[1, 2], [3]]) == [3, 3]


def test_split_parts():
    assert blas.split_parts(list(range(7)), 3) == [[0, 1, 2], [3, 4], [5, 6]]
    assert blas.split_parts(range(3)) == [range(0, 1), range(1, 2), range(2, 3)]
    assert blas.split_parts(range(2), 5) == [range(0, 1), range(1, 2)]
    assert blas.split_parts([], 4) == blas.split_parts([]) == []
    assert [len(p) for p in blas.split_parts(range(100), 8)] == [13] * 4 + [12] * 4


def test_run_parts_keeps_order_and_raises_worker_errors():
    """Results come in part order whichever thread ran a part, every part runs once on
    single-threaded GEMMs, and a failing part raises in the caller after the others ended,
    with the GEMMs' thread count given back."""
    threads = blas.blas_threads()
    seen = []

    def part(items):
        time.sleep(0.002 * (items[0] % 3))          # parts finish out of order
        seen.append((items[0], blas._THREADS[0]() if blas._THREADS else 1))
        return [i * 10 for i in items]

    parts = blas.split_parts(range(40), 20)
    assert blas.run_parts(part, parts, 3) == [[i * 10 for i in p] for p in parts]
    assert sorted(i for i, _ in seen) == [p[0] for p in parts]
    assert {t for _, t in seen} == {1} or blas._THREADS is None
    assert blas.run_parts(part, [[1]], 4) == [[10]]

    ran = []

    def fail_on_9(items):
        ran.append(items)
        if 9 in items:
            raise MemoryError("part with 9")
        return items

    with pytest.raises(MemoryError, match="part with 9"):
        blas.run_parts(fail_on_9, blas.split_parts(range(10)), 2)
    assert range(9, 10) in ran
    assert blas.blas_threads() == threads


def test_run_parts_inside_a_part_runs_in_place():
    """A part that splits work again must not wait on the busy workers."""
    def outer(items):
        return [blas.run_parts(list, [[i], [i + 10]], 2) for i in items]

    assert blas.run_parts(outer, [[1], [2]], 2) == [[[[1], [11]]], [[[2], [12]]]]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_run_parts_after_fork():
    """A child forked after parts ran (e.g. by multiprocessing) starts its own threads."""
    assert blas.run_parts(sum, [[1, 2], [3, 4]], 2) == [3, 7]
    pid = os.fork()
    if pid == 0:
        code = 3
        try:
            code = 0 if blas.run_parts(sum, [[1, 2], [3, 4]], 2) == [3, 7] else 4
        finally:
            os._exit(code)
    deadline = time.monotonic() + 30
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("run_parts hung in a forked child")
        time.sleep(0.05)
    assert os.waitstatus_to_exitcode(status) == 0


def test_run_parts_keeps_its_workers():
    """The worker threads persist from call to call (a failing part does not lose one), and
    two threads calling at once both get their results in order."""
    import threading
    ran_on = []

    def part(items):
        ran_on.append(threading.get_ident())
        time.sleep(0.001)
        return [i + 1 for i in items]

    for _ in range(3):
        assert blas.run_parts(part, [[i] for i in range(8)], 2) == [[i + 1] for i in range(8)]
    workers = set(ran_on) - {threading.get_ident()}
    assert len(workers) == 1
    def fail_on_5(items):
        if 5 in items:
            raise ValueError("part 5")
        return part(items)

    with pytest.raises(ValueError, match="part 5"):
        blas.run_parts(fail_on_5, [[i] for i in range(8)], 2)
    ran_on.clear()
    assert blas.run_parts(part, [[i] for i in range(8)], 2) == [[i + 1] for i in range(8)]
    assert set(ran_on) - {threading.get_ident()} <= workers
    assert sum(t.name.startswith("caffepar-part") for t in threading.enumerate()) \
        == len(blas._WORKERS)

    got = {}

    def call(key):
        got[key] = blas.run_parts(lambda p: [key, p], list(range(16)), 2)

    threads = [threading.Thread(target=call, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert got == {k: [[k, i] for i in range(16)] for k in range(4)}


def test_run_parts_after_an_interrupted_wait(monkeypatch):
    """A wait for the workers cut short (Ctrl-C) leaves them to end that call's parts; the
    next call runs on new workers and gets every result."""
    def slow(p):
        time.sleep(0.002)
        return p

    blas.run_parts(slow, list(range(4)), 2)
    old = blas._WORKERS[0]
    real = blas._Worker.join
    monkeypatch.setattr(blas._Worker, "join", lambda w, spin: (_ for _ in ()).throw(
        KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        blas.run_parts(slow, list(range(40)), 2)
    monkeypatch.setattr(blas._Worker, "join", real)
    assert old not in blas._WORKERS
    assert blas.run_parts(slow, list(range(40)), 2) == list(range(40))


@pytest.mark.parametrize("compiled", [True, False])
def test_gate_posts_and_waits(compiled):
    """A gate's waiter sees every post, whether it polled (compiled) or blocked first; a poll
    gives up after its time and leaves the waiter marked blocked, so the post wakes it."""
    import threading
    sync = blas._sync() if compiled else None
    if compiled and sync is None:
        pytest.skip("no compiled kernels")
    gate = blas._Gate(sync)
    if compiled:
        start = time.perf_counter()
        assert sync[1](gate.address, 0, 2_000_000) == -1           # 2 ms of polling
        assert time.perf_counter() - start >= 0.002
        assert gate.cells[1] == 1
        assert sync[0](gate.address) == 1                           # the post sees it blocked
        assert sync[1](gate.address, 0, 0) == 1 and gate.cells[1] == 0
        gate.seen = 1
    seen = []

    def waiter():
        for _ in range(200):
            gate.wait(0.0005)
            seen.append(gate.seen)

    t = threading.Thread(target=waiter)
    t.start()
    for i in range(200):
        gate.post()
        if i % 50 == 0:
            time.sleep(0.003)       # past the poll: the waiter blocks before this post
        deadline = time.monotonic() + 10
        while len(seen) <= i and time.monotonic() < deadline:
            time.sleep(0)
    t.join(10)
    first = 2 if compiled else 1
    assert seen == list(range(first, first + 200))

    # A worker's round: post the end of one piece of work, wait for the next, in one call.
    ping, pong = blas._Gate(sync), blas._Gate(sync)

    def player():
        ping.wait(0.0002)
        for i in range(100):
            if i % 25 == 0:
                time.sleep(0.003)   # the other side blocked before this post
            ping.post_then_wait(pong, 0 if i % 10 == 9 else 0.0002)

    t = threading.Thread(target=player)
    t.start()
    for i in range(101):
        ping.post()
        if i % 30 == 0:
            time.sleep(0.003)       # the player blocked before this post
        if i < 100:
            pong.wait(0.0002)
    t.join(10)
    assert not t.is_alive() and (ping.seen, pong.seen) == (101, 100)


def test_run_parts_polls_only_on_quiet_cores(monkeypatch):
    """Workers poll for the next call only while the cores are not contended: with a long
    poll allowed, a worker between calls 10 ms apart takes CPU time on quiet cores and none
    beyond its parts on contended ones (CAFFEPAR_CONTENDED=1)."""
    if blas._sync() is None or not hasattr(time, "pthread_getcpuclockid"):
        pytest.skip("no compiled kernels or no per-thread CPU clock")
    monkeypatch.setattr(blas, "SPIN_SECONDS", 0.005)

    def worker_cpu(contended):
        monkeypatch.setenv("CAFFEPAR_CONTENDED", str(int(contended)))
        monkeypatch.setattr(blas, "cores_contended", blas.Contention())
        blas.run_parts(list, [[i] for i in range(8)], 2)
        clock = time.pthread_getcpuclockid(blas._WORKERS[0].thread.ident)
        start = time.clock_gettime(clock)
        for _ in range(20):
            time.sleep(0.01)
            assert blas.run_parts(list, [[i] for i in range(8)], 2) == [[i] for i in range(8)]
        time.sleep(0.01)
        return time.clock_gettime(clock) - start, blas._WORKERS[0].spin

    busy, spin = worker_cpu(True)
    assert spin == 0.0 and busy < 0.02        # polling would take 20 x 5 ms = 0.1 s
    quiet, spin = worker_cpu(False)
    assert spin == 0.005 and quiet > busy


def test_contention_from_the_run_queue_wait(tmp_path, monkeypatch):
    """Contended while the main thread waited for a core at least CONTENDED_WAIT of the wall
    time since the last reading; read at most once a period; forced by CAFFEPAR_CONTENDED."""
    monkeypatch.delenv("CAFFEPAR_CONTENDED", raising=False)
    stat = tmp_path / "schedstat"
    stat.write_text("5000 0 3\n")
    c = blas.Contention(str(stat), period=0.25)
    assert not c(now=10.0)                          # a first reading has nothing to compare
    stat.write_text(f"9000 {int(0.3e9)} 9\n")       # waited 0.3 s of the next 1 s
    assert c(now=11.0)
    stat.write_text(f"9000 {int(0.31e9)} 9\n")
    assert c(now=11.1)                              # within the period: the last answer
    assert not c(now=12.0)                          # 0.01 s of 0.9 s
    stat.write_text(f"9000 {int(0.31e9 + 0.19e9)} 9\n")
    assert not c(now=13.0)                          # 0.19 s of 1 s: below the share
    assert not blas.Contention(str(tmp_path / "missing"))(now=1.0)
    monkeypatch.setenv("CAFFEPAR_CONTENDED", "1")
    assert blas.Contention(str(tmp_path / "missing"))()


@pytest.mark.skipif(not os.path.exists("/proc/self/schedstat"), reason="no schedstat")
def test_contention_seen_beside_busy_processes(monkeypatch):
    """More busy processes than cores keep this one waiting for a core, and the reading
    notices."""
    monkeypatch.delenv("CAFFEPAR_CONTENDED", raising=False)
    import subprocess
    import sys
    cores = len(os.sched_getaffinity(0))
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
            for _ in range(cores + 1)]
    try:
        c = blas.Contention(period=0.0)
        c()
        t0 = time.monotonic()
        while time.monotonic() - t0 < 0.5:
            pass
        assert c()
    finally:
        for p in hogs:
            p.kill()
            p.wait()


@pytest.mark.parametrize("shape,trans_a,trans_b,beta",
                         [((40, 517, 500), False, True, 0.0), ((700, 64, 130), True, False, 1.0)])
def test_contended_gemm_runs_in_parts(shape, trans_a, trans_b, beta, monkeypatch):
    """On contended cores a big GEMM is cut along c's longer side into parts that the
    threads take as they come, with the result one BLAS thread gives; a quiet machine leaves
    it to BLAS."""
    if blas._THREADS is None:
        pytest.skip("this BLAS's thread count cannot be set")
    m, k, n = shape
    rng = np.random.default_rng(1)
    a = rng.standard_normal((k, m) if trans_a else (m, k)).astype(np.float32)
    b = rng.standard_normal((n, k) if trans_b else (k, n)).astype(np.float32)
    c0 = rng.standard_normal((m, n)).astype(np.float32)
    want = (a.T if trans_a else a) @ (b.T if trans_b else b) + beta * c0
    runs = []
    real = blas.run_parts
    monkeypatch.setattr(blas, "run_parts", lambda fn, parts, w=None: runs.append(parts)
                        or real(fn, parts, w))
    monkeypatch.setattr(blas, "blas_threads", lambda: 2)
    monkeypatch.setattr(blas, "SPLIT_MIN_MACS", 1 << 16)
    monkeypatch.setattr(blas, "cores_contended", lambda: True)
    c = c0.copy()
    blas.gemm_views(a, b, c, trans_a, trans_b, beta)
    np.testing.assert_allclose(c, want, rtol=1e-4, atol=1e-3)
    split = c.copy()
    size = max(m, n)
    (parts,) = runs
    assert len(parts) == min(8, size // 64) and parts[0][0] == 0 and parts[-1][1] == size
    assert all(lo < hi and lo % 16 == 0 for lo, hi in parts)
    assert all(p[1] == q[0] for p, q in zip(parts, parts[1:]))
    monkeypatch.setattr(blas, "cores_contended", lambda: False)
    c = c0.copy()
    blas.gemm_views(a, b, c, trans_a, trans_b, beta)
    np.testing.assert_allclose(c, want, rtol=1e-4, atol=1e-3)
    assert len(runs) == 1
    c = c0.copy()
    with blas.single_threaded_blas():
        blas.gemm_views(a, b, c, trans_a, trans_b, beta)
    np.testing.assert_array_equal(split, c)


def test_scratch_keeps_one_buffer_per_role_and_its_views():
    """A role's work array is the same memory on every call; a larger request replaces the
    buffer, and the views kept of the old one are not handed out again; release_workspace
    frees them all."""
    from caffepar.nn.blas import release_workspace, scratch
    a = scratch("test_role", (4, 8), np.float32)
    assert scratch("test_role", (4, 8), np.float32) is a
    b = scratch("test_role", (32,), np.float32)
    assert np.shares_memory(a, b) and b.shape == (32,)
    big = scratch("test_role", (64, 8), np.float32, zero=True)
    assert not big.any()
    again = scratch("test_role", (4, 8), np.float32)
    assert np.shares_memory(again, big) and not np.shares_memory(again, a)
    assert scratch("test_role", [4, 8], np.float32).shape == (4, 8)
    release_workspace()
    assert not np.shares_memory(scratch("test_role", (4, 8), np.float32), big)
