"""The lab scripts' bookkeeping on synthetic runs: top-k accuracy's times leave out what is not
training (gaps between pieces, a resume's repeated test), and the campaign's --until reads a
time of day across midnight."""
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import netlab_campaign  # noqa: E402
import netlab_topk_accuracy as topk  # noqa: E402

LOG_LINE = "I1125 {t} 7 solver.py:1] {text}\n"


def segment(folder, n, rows, tests):
    """Segment n: CSV rows (iter, seconds, accuracy or None), log lines of its tests
    (iteration, start, end, accuracy)."""
    with open(folder / f"segment_{n}.csv", "w") as f:
        f.write("iter,loss,lr,seconds,data_wait_s,test/accuracy,test/loss\n")
        for it, seconds, acc in rows:
            f.write(f"{it},1.0,0.001,{seconds},0,{'' if acc is None else acc},"
                    f"{'' if acc is None else 1.0}\n")
    with open(folder / f"segment_{n}.log", "w") as f:
        for it, start, end, acc in tests:
            f.write(LOG_LINE.format(t=start, text=f"Iteration {it}, Testing net (#0)"))
            f.write(LOG_LINE.format(t=end, text=f"    Test net output #0: accuracy = {acc}"))


def test_topk_times_count_iterations_once_and_tests_apart(tmp_path):
    # piece 1: iterations 0-3, tests at 0 and 2 (each 0.5 s) and after the run at 4 (0.5 s)
    segment(tmp_path, 0, [(0, 1.5, 0.1), (1, 1.0, None), (2, 1.5, 0.5), (3, 1.0, None)],
            [(0, "10:00:00.000000", "10:00:00.500000", 0.1),
             (2, "10:00:03.000000", "10:00:03.500000", 0.5),
             (4, "10:00:05.000000", "10:00:05.500000", 0.6)])
    # piece 2, an hour later, resumed at 4: tests 4 again (0.25 s this time), reaches 0.7 at 6
    segment(tmp_path, 1, [(4, 1.25, 0.6), (5, 1.0, None), (6, 1.5, 0.75), (7, 1.0, None)],
            [(4, "11:00:00.000000", "11:00:00.250000", 0.6),
             (6, "11:00:02.000000", "11:00:02.500000", 0.75),
             (8, "11:00:04.000000", "11:00:04.500000", 0.8)])
    points = topk.curve(tmp_path)
    assert [p[0] for p in points] == [0, 2, 4, 6, 8]
    assert [p[1] for p in points] == [0.1, 0.5, 0.6, 0.75, 0.8]
    # train s: 1 s per iteration before the test; wall s adds the tests up to this one
    assert [p[3] for p in points] == pytest.approx([0, 2, 4, 6, 8])
    assert [p[4] for p in points] == pytest.approx([0.5, 3.0, 5.25, 7.75, 10.25])
    assert topk.time_to(points) == (6, pytest.approx(6.0), pytest.approx(7.75))
    assert topk.time_to(points, target=0.9) is None


def test_until_reads_a_time_of_day_across_midnight():
    at = lambda h, m: time.struct_time((2026, 1, 1, h, m, 0, 0, 1, 0))
    assert not netlab_campaign.past("01:15", at(23, 40))
    assert netlab_campaign.past("01:15", at(1, 20))
    assert netlab_campaign.past("23:50", at(0, 10))
    assert not netlab_campaign.past("00:30", at(23, 50))
    assert netlab_campaign.past("10:00", at(10, 0))
