"""The results scripts draw through one guard: without matplotlib they still write their CSV
and markdown, and say in one line that no PNG was written."""
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
sys.path.insert(0, str(SCRIPTS))

from figures import pyplot  # noqa: E402


def test_pyplot_without_matplotlib_is_none_and_says_so(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)     # import fails as if not installed
    assert pyplot() is None
    assert capsys.readouterr().err.strip() == (
        "matplotlib is not installed (pip install 'caffepar[plot]' adds it): no PNG written")


def test_every_script_draws_through_the_guard():
    direct = [p.name for p in SCRIPTS.glob("*.py")
              if p.name != "figures.py" and "import matplotlib" in p.read_text()]
    assert direct == []
