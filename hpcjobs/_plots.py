"""matplotlib for the reports' figures, where it is installed.

It is an optional extra (``pip install 'hpcjobs[report]'``). Without it a
command that measured or trained for minutes still writes its tables and
records, and says which figures it left out, instead of ending in a
traceback after the work (``bench allreduce --out``, ``experiment``,
``plan --plot``, ``model``).
"""

from __future__ import annotations

MISSING = "matplotlib is not installed (pip install 'hpcjobs[report]')"


def pyplot():
    """``matplotlib.pyplot`` on the file-only Agg backend, or None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt
