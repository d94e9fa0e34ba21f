"""``make gpu-check``: everything that needs a GPU, in one command, on a GPU machine.

Runs the tests marked ``gpu`` (the CUDA channel model against TensorPipe's log, notebook
02's CPU-vs-CUDA comparison, the CUDA paths of rpcnb), then the GPU benchmark
(``bench/gpu.py``), and prints one table. Without CUDA it says so and exits 0.

    make gpu-check                 # with the project's .venv
    make gpu-check PY=python3      # on a machine where the packages come from PYTHONPATH
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    import torch

    if not torch.cuda.is_available():
        print(f"gpu-check: no CUDA device here (torch {torch.__version__}, built "
              f"{'with CUDA ' + torch.version.cuda if torch.version.cuda else 'without CUDA'}"
              "): nothing to check. Run it on a machine with a GPU (see GPU.md).")
        return 0
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    print(f"gpu-check: {len(gpus)} GPU(s): {', '.join(gpus)}; torch {torch.__version__}")
    tests = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p",
                            "no:cacheprovider", "tests"], cwd=ROOT, capture_output=True,
                           text=True)
    print(tests.stdout[-6000:])
    summary = (tests.stdout.strip().splitlines() or ["(no summary)"])[-1]
    bench = subprocess.run([sys.executable, "-m", "bench.gpu"], cwd=ROOT, capture_output=True,
                           text=True)
    print(bench.stdout[-4000:], bench.stderr[-2000:] if bench.returncode else "")
    passed = re.search(r"(\d+) passed", summary)
    failed = re.search(r"(\d+) failed", summary)
    rows = [
        ("gpu tests", f"{passed.group(1) if passed else 0} passed, "
                      f"{failed.group(1) if failed else 0} failed ({summary})"),
        ("GPU benchmark", "ok: bench/results/gpu.json" if bench.returncode == 0
         else f"failed (exit {bench.returncode})"),
    ]
    for line in bench.stdout.splitlines():
        if line.startswith(("PASS", "MISS")):
            rows.append(("target", line))
    width = max(len(a) for a, _ in rows)
    print("\n".join(f"{a.ljust(width)}  {b}" for a, b in rows))
    return 0 if tests.returncode == 0 and bench.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
