"""The script baselines of tests/kernel/test_programs.py, recorded: what each program in this
folder gives when it runs as a script (``python PROGRAM.py OUT.json``: ``mp.spawn`` and
``init_rpc``, launch.py), kept in tests/data/program_baselines.json (committed: CI runs on a
fresh clone) under a key of everything that decides it. A test whose key matches uses the
recorded result and output instead of running the script; one whose key does not runs the
script, as before, and warns that the baseline should be recorded again:

    .venv/bin/python tests/programs/baselines.py             # record every stale baseline
    .venv/bin/python tests/programs/baselines.py NAME ...    # record these again
    .venv/bin/python tests/programs/baselines.py --all       # record all of them again
    .venv/bin/python tests/programs/baselines.py --check     # exit 1 when one is stale

The key is a SHA-256 of the program's source, launch.py's source, torch's version, Python's
major.minor, the CPU capability torch computes with (its SIMD kernels: AVX2, AVX512, ...;
their float results differ in the last bits) and ``FORMAT``, which says how a script is run
here (``run_script``): change that function, bump ``FORMAT``, record again. The programs
seed every random generator they use and import nothing but torch.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import importlib.metadata
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rpcnb.procs.processes import descendants

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: run as a script too
from pids import Seen  # noqa: E402

PROGRAMS = Path(__file__).resolve().parent
BASELINES = PROGRAMS.parent / "data" / "program_baselines.json"
RECORD = "python tests/programs/baselines.py"  # what a stale baseline's warning says to run
FORMAT = 1
MARKER = "# --- launcher (not pasted) ---"
SCRIPT_TIMEOUT = 120  # seconds; a script takes about 15 here (4 processes import torch)


class StaleBaseline(UserWarning):
    """A program's recorded baseline is not for its source or this torch: the script ran."""


@dataclass
class ScriptRun:
    result: Any
    pids: dict[str, list[int]]  # name -> [pid, parent pid], as each process reported
    script_pid: int
    seen: set[int]  # the script's descendants, looked at while it ran
    alive_at_exit: set[int]  # those of them still running when the script had exited
    stdout: str
    seconds: float


def names() -> list[str]:
    """The programs: every file of this folder with a launcher (the ``MARKER`` line)."""
    return sorted(p.stem for p in PROGRAMS.glob("*.py") if MARKER in p.read_text().splitlines())


@functools.cache
def _torch() -> tuple[str, str]:
    """torch's version and the CPU capability it computes with (a subprocess: importing
    torch here would cost the test process its memory and a second)."""
    code = "import torch; print(torch.__version__); print(torch.backends.cpu.get_cpu_capability())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120).stdout.split()
    assert out[0] == importlib.metadata.version("torch"), out
    return out[0], out[1]


def made_from() -> dict[str, str]:
    """What decides a script's result besides the sources, as it is here."""
    torch, cpu = _torch()
    return {"torch": torch, "python": f"{sys.version_info.major}.{sys.version_info.minor}",
            "cpu_capability": cpu, "format": str(FORMAT)}


def key(name: str) -> str:
    digest = hashlib.sha256()
    for part in ((PROGRAMS / f"{name}.py").read_bytes(), (PROGRAMS / "launch.py").read_bytes(),
                 json.dumps(made_from(), sort_keys=True).encode()):
        digest.update(hashlib.sha256(part).digest())
    return digest.hexdigest()


def load() -> dict[str, Any]:
    return json.loads(BASELINES.read_text())["programs"] if BASELINES.exists() else {}


def recorded(name: str) -> dict[str, Any] | None:
    """The recorded baseline of ``name`` (``result``, ``stdout``) when its key matches."""
    entry = load().get(name)
    return entry if entry is not None and entry["key"] == key(name) else None


def run_script(name: str, tmp: Path) -> ScriptRun:
    """``python PROGRAM.py OUT.json`` with a timeout; every process it started is killed
    by pid at the end."""
    out = tmp / f"{name}.json"
    log_out, log_err = tmp / f"{name}.stdout", tmp / f"{name}.stderr"
    # block-buffered (stdout is a file): each process writes its lines whole when it exits,
    # where unbuffered prints of several processes interleave mid-line
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    start = time.monotonic()
    with open(log_out, "w") as so, open(log_err, "w") as se:
        proc = subprocess.Popen([sys.executable, str(PROGRAMS / f"{name}.py"), str(out)],
                                stdout=so, stderr=se, cwd=PROGRAMS, env=env)
    seen = Seen()
    try:
        while proc.poll() is None and time.monotonic() < start + SCRIPT_TIMEOUT:
            seen.update(descendants(proc.pid))
            time.sleep(0.05)
        seen.update(descendants(proc.pid))
        alive_at_exit = set(seen.alive())
    finally:
        seen.kill()
        proc.kill()  # its own pid stays its own until it is reaped, just below
        proc.wait(timeout=10)
    seconds = time.monotonic() - start
    deadline = time.monotonic() + 5  # SIGKILL is delivered asynchronously
    while time.monotonic() < deadline and seen.alive():
        time.sleep(0.05)
    assert not seen.alive(), f"{name}.py left processes running"
    assert seconds < SCRIPT_TIMEOUT, f"{name}.py did not finish in {SCRIPT_TIMEOUT} s"
    assert proc.returncode == 0, (
        f"{name}.py exited with {proc.returncode} after {seconds:.1f} s:\n"
        f"{log_err.read_text()[-4000:]}")
    ran = json.loads(out.read_text())
    return ScriptRun(ran["result"], ran["pids"], proc.pid, set(seen), alive_at_exit,
                     log_out.read_text(), seconds)


def record(which: list[str]) -> None:
    """Run the scripts ``which`` and write their baselines (the others' kept)."""
    entries = load()
    for name in which:
        with tempfile.TemporaryDirectory(prefix="rpcnb-baseline-") as tmp:
            run = run_script(name, Path(tmp))
        entries[name] = {"key": key(name), "made_from": made_from(), "result": run.result,
                         "stdout": run.stdout}
        print(f"{name}: recorded ({run.seconds:.1f} s)", flush=True)
    BASELINES.parent.mkdir(exist_ok=True)
    BASELINES.write_text(json.dumps(
        {"about": "script baselines of tests/kernel/test_programs.py, written by "
                  "tests/programs/baselines.py (its docstring says when)",
         "programs": {name: entries[name] for name in sorted(entries) if name in names()}},
        indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=RECORD, description=__doc__.split("\n\n")[0])
    ap.add_argument("names", nargs="*", help="programs to record again (default: the stale ones)")
    ap.add_argument("--all", action="store_true", help="record every program again")
    ap.add_argument("--check", action="store_true", help="record nothing; exit 1 if one is stale")
    args = ap.parse_args(argv)
    unknown = set(args.names) - set(names())
    if unknown:
        ap.error(f"no such program: {', '.join(sorted(unknown))} (there are {', '.join(names())})")
    stale = [name for name in names() if recorded(name) is None]
    if args.check:
        print("stale: " + ", ".join(stale) if stale else "every baseline is current")
        return 1 if stale else 0
    which = names() if args.all else args.names or stale
    if not which:
        print("every baseline is current")
        return 0
    record(which)
    return 0


if __name__ == "__main__":
    sys.exit(main())
