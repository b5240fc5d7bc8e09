"""The plot library of the results scripts, where it is installed."""
import sys


def pyplot():
    """matplotlib's pyplot drawing to files, or None, after one line saying so, where matplotlib
    is not installed: the CSV and markdown are the results, the PNG only their picture."""
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed (pip install 'caffepar[plot]' adds it): no PNG "
              "written", file=sys.stderr)
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt
