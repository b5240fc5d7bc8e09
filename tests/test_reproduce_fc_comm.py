"""scripts/reproduce_fc_comm.py's pieces: the paper's winners and the report, on synthetic rows."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import reproduce_fc_comm as fc  # noqa: E402


def test_paper_winners_follow_paper_md():
    cells = [(l, p, b) for l in fc.LAYERS for p in fc.RANKS for b in fc.BATCHES]
    model = {c for c in cells if fc.paper_winner(*c) == "MODEL"}
    assert {c for c in cells if c[0] == "fc6"} <= model
    assert {c for c in cells if c[0] == "fc7" and c[1] <= 4} <= model
    assert ("fc7", 8, 64) in model and ("fc7", 8, 128) not in model
    fc8 = sorted((p, b) for l, p, b in model if l == "fc8")
    assert fc8 == [(2, b) for b in fc.BATCHES if b <= 64] + [(4, 1)]


def test_report_on_synthetic_rows(tmp_path, monkeypatch):
    from caffepar.parallel.cost import CostModel
    rows = []
    for layer in fc.LAYERS:
        for p in (2, 4):
            for b in fc.BATCHES:
                for mode in fc.MODES:
                    # MODEL wins below batch 16 everywhere (synthetic).
                    ms = (10.0 if b < 16 else 1.0) if mode == "DATA" else 5.0
                    rows.append({"layer": layer, "transport": "shm", "np": p, "batch": b,
                                 "mode": mode, "comm_ms": ms})
    models = {"shm": CostModel.from_alpha_beta(1e-6, 1e-10)}
    cells = fc.summarize(rows, models)
    assert len(cells) == 3 * 2 * 8
    assert all(c["measured_winner"] == ("MODEL" if c["batch"] < 16 else "DATA") for c in cells)
    assert all("auto_choice" in c for c in cells)
    text = fc.report(rows, cells, models, ["shm"], [2, 4])
    agree = sum(c["measured_winner"] == c["paper_winner"] for c in cells)
    assert f"shm: {agree} of 48 cells" in text
    assert "fc6 MODEL is 2.0x faster than DATA (paper: 33x)" in text
    assert "AUTO picks the measured faster mode in" in text


def test_check_runs_from_the_committed_csv(tmp_path, monkeypatch):
    """Without this checkout's sweep state the rows come from results/fc_comm.csv, and AUTO's
    agreement is counted against them."""
    import csv
    from caffepar.parallel.cost import CostModel
    results = tmp_path / "results"
    results.mkdir()
    monkeypatch.setattr(fc, "STATE", tmp_path / "no_state")
    monkeypatch.setattr(fc, "RESULTS", results)
    with open(results / "fc_comm.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fc.FIELDS, extrasaction="ignore")
        w.writeheader()
        for b, data_ms, model_ms in ((1, 100.0, 0.5), (128, 1.0, 50.0)):
            for mode, ms in (("DATA", data_ms), ("MODEL", model_ms)):
                w.writerow({"layer": "fc6", "transport": "tcp", "np": 2, "batch": b,
                            "mode": mode, "comm_ms": ms})
    rows = fc.read_rows(["tcp"], [2, 4])
    assert len(rows) == 4 and {r["np"] for r in rows} == {2}
    # Bandwidth-bound: fc6 MODEL at batch 1 and at batch 128 (2*128*25088 values < K*N).
    models = {"tcp": CostModel.from_alpha_beta(0.0, 1e-9)}
    cells = fc.summarize(rows, models)
    agree, n, _median, _p90 = fc.auto_agreement(cells, "tcp")
    assert (agree, n) == (1, 2)
    assert fc.auto_agreement(cells, "shm") is None
