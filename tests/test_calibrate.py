"""Engine choice by measurement that holds between runs: close calls timed again until clear or
settled as a tie by the candidates' order, the cache kept per CPU model and build, and
`caffepar time --engines` printing the choice and its margin."""

import pytest

from caffepar.cli import main
from caffepar.nn import calibrate, native

NET = """name: "engines"
layer { name: "data" type: "DummyData" top: "data" top: "label"
  dummy_data_param { shape { dim: 2 dim: 3 dim: 12 dim: 12 } shape { dim: 2 }
                     data_filler { type: "gaussian" } data_filler { type: "constant" } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
  convolution_param { num_output: 8 kernel_size: 3 pad: 1 weight_filler { type: "gaussian" } } }
layer { name: "ip1" type: "InnerProduct" bottom: "conv1" top: "ip1"
  inner_product_param { num_output: 4 weight_filler { type: "gaussian" } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip1" bottom: "label" top: "loss" }
"""


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """Engine choices in a fresh file of their own (the compiled kernels where they are)."""
    monkeypatch.setenv("CAFFEPAR_CONV_ENGINES", "measure")
    monkeypatch.setattr(calibrate, "_chosen", {})
    path = tmp_path / calibrate._hashed_path(native).name
    monkeypatch.setattr(calibrate, "_cache_file", lambda: path)
    return tmp_path


def fake_timer(monkeypatch, series):
    """_timed replaced: engine e's n-th run takes series[e](n) seconds; returns the runs."""
    runs = []
    counts = {}

    def timed(run, engine):
        counts[engine] = counts.get(engine, 0) + 1
        runs.append(engine)
        return series[engine](counts[engine])

    monkeypatch.setattr(calibrate, "_timed", timed)
    return runs


def test_close_call_settled_by_order_whatever_the_noise(cache, monkeypatch):
    """Two engines within 2%, which of them measures faster changing from run to run: the
    extra rounds run, and every run (fresh memory and cache) keeps the first listed."""
    picks = []
    for seed in range(4):
        monkeypatch.setattr(calibrate, "_chosen", {})
        for f in cache.glob("conv-engines-*.json"):
            f.unlink()
        a, b = (1.0, 1.015) if seed % 2 else (1.015, 1.0)
        runs = fake_timer(monkeypatch, {"band": lambda n, a=a: a + 0.01 * (n % 3),
                                        "im2col": lambda n, b=b: b + 0.01 * (n % 2),
                                        "grid": lambda n: 3.0})
        picks.append(calibrate.choose(f"shape {seed}", ["band", "im2col", "grid"],
                                      lambda: None, "test"))
        # 3 first runs, ROUNDS over the two within 2x, MORE_ROUNDS more: still within CLEAR.
        assert len(runs) == 3 + 2 * calibrate.ROUNDS + 2 * calibrate.MORE_ROUNDS
    assert picks == ["band"] * 4
    # Outside TIE (but within CLEAR) the faster one is kept.
    runs = fake_timer(monkeypatch, {"band": lambda n: 1.04, "im2col": lambda n: 1.0})
    assert calibrate.choose("apart", ["band", "im2col"], lambda: None, "test") == "im2col"


def test_clear_winner_wins_and_stops_early(cache, monkeypatch):
    """A runner-up close at first but clearly slower over more rounds: the extra rounds stop
    as soon as the gap is clear, and the faster one is kept with its times."""
    runs = fake_timer(monkeypatch, {"band": lambda n: 1.0 if n < 6 else 0.8,
                                    "im2col": lambda n: 1.02})
    assert calibrate.choose("k", ["im2col", "band"], lambda: None, "test") == "band"
    assert len(runs) < 2 + 2 * calibrate.ROUNDS + 2 * calibrate.MORE_ROUNDS
    entry = calibrate.last_choice()
    assert entry == {"engine": "band", "ms": {"band": 800.0, "im2col": 1020.0}}
    assert calibrate.margin(entry) == ("im2col", pytest.approx(1.275))
    # Cached: read back (another process) without timing again.
    monkeypatch.setattr(calibrate, "_chosen", {})
    before = len(runs)
    assert calibrate.choose("k", ["im2col", "band"], lambda: None, "test") == "band"
    assert len(runs) == before and calibrate.last_choice()["ms"]["im2col"] == 1020.0


def test_old_cache_entries_still_read(cache, monkeypatch):
    path = calibrate._cache_file()
    calibrate._save(path, "k", "grid")
    fake_timer(monkeypatch, {})
    assert calibrate.choose("k", ["im2col", "grid"], lambda: None, "test") == "grid"
    assert calibrate.margin(calibrate.last_choice()) is None


def test_cache_per_cpu_model_and_build(cache, monkeypatch):
    cpu_model = native.cpu_model
    first = calibrate._hashed_path(native)
    monkeypatch.setattr(native, "cpu_model", lambda: "GenuineIntel 6 143 Xeon")
    assert calibrate._hashed_path(native) != first
    monkeypatch.setattr(native, "cpu_model", cpu_model)
    assert calibrate._hashed_path(native) == first
    monkeypatch.setenv("CAFFEPAR_CFLAGS", "-march=haswell")
    assert calibrate._hashed_path(native) != first


def test_time_engines_prints_choice_and_margin(cache, tmp_path, monkeypatch, capsys):
    model = tmp_path / "net.prototxt"
    model.write_text(NET)
    with pytest.raises(SystemExit) as done:
        main(["time", "--model", str(model), "--iterations", "1", "--engines"])
    out, err = capsys.readouterr()
    assert done.value.code == 0, err
    section = out.split("Engines (layer, type, engine")[1].split("*** Benchmark ends")[0]
    lines = {line.split("\t")[0].strip(): line.split("\t") for line in
             section.strip().splitlines()[1:]}
    assert set(lines) == {"conv1", "ip1"}
    name, kind, engine, how = lines["conv1"]
    assert kind == "Convolution" and lines["ip1"][1] == "InnerProduct"
    assert ("won by" in how or "a tie" in how) and " ms vs " in how
    entry = calibrate._load(calibrate._cache_file())
    conv = [v for k, v in entry.items() if k.startswith("2x3x12x12 8 k3x3")]
    assert conv and conv[0]["engine"] == engine
    runner, ratio = calibrate.margin(conv[0])
    assert f"vs {runner} " in how
