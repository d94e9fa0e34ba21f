"""``make gpu-check``: everything that needs a GPU, in one command, on a GPU machine.

Runs the tests marked ``gpu`` (the CUDA channel model against TensorPipe's log, notebook
02's CPU-vs-CUDA comparison, the CUDA paths of rpcnb), then the GPU benchmark
(``bench/gpu.py``), and prints one table. Without CUDA it says so and exits 0.

    make gpu-check                 # with the project's .venv
    make gpu-check PY=python3      # on a machine where the packages come from PYTHONPATH
    make gpu-check GPU_CHECK_ARGS=--rehearse   # here, without a GPU: the same steps

Only the test files that hold ``gpu`` tests are collected: a GPU machine without network
has none of the browser's, the clusters' or the docs' packages, and one module that
fails to import would stop pytest before any test ran. ``--rehearse`` runs every step on
a machine without CUDA too (the tests then skip and the benchmark says so), to find a
missing package or a broken step before a GPU machine's time is spent; it fails where a
step fails.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GPU_MARK = re.compile(r"pytest\.mark\.gpu\b")
LOG = ROOT / "bench" / "results" / "gpu-tests.log"


def gpu_test_files() -> list[str]:
    """The test files that hold ``gpu``-marked tests, relative to the project root."""
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("**/test_*.py")
                  if GPU_MARK.search(p.read_text(encoding="utf-8")))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="gpu_check")
    ap.add_argument("--rehearse", action="store_true",
                    help="run every step without CUDA too (tests skip): checks the set-up")
    args = ap.parse_args(argv)
    import torch

    built = f"built {'with CUDA ' + torch.version.cuda if torch.version.cuda else 'without CUDA'}"
    if torch.cuda.is_available():
        gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        print(f"gpu-check: {len(gpus)} GPU(s): {', '.join(gpus)}; torch {torch.__version__}")
    elif args.rehearse:
        print(f"gpu-check --rehearse: no CUDA device here (torch {torch.__version__}, {built});"
              " running every step, the gpu tests will skip")
    else:
        print(f"gpu-check: no CUDA device here (torch {torch.__version__}, {built}): nothing "
              "to check. Run it on a machine with a GPU (see GPU.md).")
        return 0
    files = gpu_test_files()
    # the whole of pytest's output, kept, and written as it comes: a crash's traceback is in
    # the middle of it, and a run cut short by the GPU machine's time limit keeps its start
    LOG.parent.mkdir(parents=True, exist_ok=True)
    with LOG.open("w", encoding="utf-8") as log:
        tests = subprocess.run([sys.executable, "-m", "pytest", "-v", "-rs", "-m", "gpu", "-p",
                                "no:cacheprovider", *files], cwd=ROOT, stdout=log,
                               stderr=subprocess.STDOUT, text=True)
    out = LOG.read_text(encoding="utf-8", errors="replace")
    print(out[-8000:])
    print(f"(pytest's whole output: {LOG.relative_to(ROOT)})")
    lines = out.strip().splitlines()
    summary = lines[-1] if lines and lines[-1].startswith("=") else (
        f"pytest stopped (exit {tests.returncode}) before its summary: see {LOG.name}")
    bench = subprocess.run([sys.executable, "-m", "bench.gpu"], cwd=ROOT, capture_output=True,
                           text=True)
    print(bench.stdout[-4000:], bench.stderr[-2000:] if bench.returncode else "")
    counts = {word: int(n) for n, word in re.findall(r"(\d+) (passed|failed|skipped|error)",
                                                     summary)}
    rows = [
        ("gpu tests", f"{counts.get('passed', 0)} passed, {counts.get('failed', 0)} failed, "
                      f"{counts.get('skipped', 0)} skipped in {len(files)} files ({summary})"),
        ("GPU benchmark", ("ok: bench/results/gpu.json" if torch.cuda.is_available()
                           else "ok: no CUDA, nothing measured") if bench.returncode == 0
         else f"failed (exit {bench.returncode})"),
    ]
    for line in bench.stdout.splitlines():
        if line.startswith(("PASS", "MISS")):
            rows.append(("target", line))
    width = max(len(a) for a, _ in rows)
    print("\n".join(f"{a.ljust(width)}  {b}" for a, b in rows))
    # pytest exits 5 when every test was deselected: a set-up that found no gpu test fails
    return 0 if tests.returncode == 0 and bench.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
