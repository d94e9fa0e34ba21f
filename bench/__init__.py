"""rpcnb's benchmarks: ``python -m bench.run`` (see docs/benchmarks.md)."""

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def python_path() -> str:
    """``PYTHONPATH`` for a process a benchmark starts: the project root first (where it
    imports ``bench.*``), then what was there (a GPU machine's packages come from it)."""
    return os.pathsep.join(
        [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
