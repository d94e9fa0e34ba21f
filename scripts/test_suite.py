"""Run the test suite the way ``make test`` and CI do, and say how long it took.

Two phases: first every test not marked ``serial``, on parallel pytest-xdist workers
(``--dist loadgroup``: the tests of a module that share a kernel or a group, and the tests
of an ``xdist_group`` such as the browser tests' one JupyterLab server, stay on one
worker); then the ``serial`` tests (those that measure time), alone on the machine, one
after another (collecting only the files that mark one). Every failure of both phases is
reported (no ``-x``). At the end: each phase's wall time and exit status, the whole run's
wall time, its slowest tests, and how often the test processes started their shared
kernel (and why one was stopped before the end); every test's time is kept in
``test-results/durations.txt`` (CI's artefact) beside the phases' JUnit XML files.

    python scripts/test_suite.py                 # make test
    python scripts/test_suite.py --fast          # make test-fast
    python scripts/test_suite.py tests/kernel/test_core.py -n 2   # a part, the same way

The exit status is 0 only when every phase passed; pytest's 5 (no tests collected) is a
failure too.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "test-results"

# What make test-fast runs: every unit test, and the kernel tests of the core flows
# (start, remote cells, RRefs, shutdown, the teardown at every step, the documented
# commands, telemetry, the magics' errors, the probe).
FAST = ["tests/unit", *(f"tests/kernel/{name}" for name in (
    "test_core.py", "test_teardown.py", "test_commands.py", "test_telemetry.py",
    "test_magic_usage.py", "test_probe.py"))]

# Parallel workers: the kernel tests mostly wait (on a worker's reply, a sleep in the cell
# under test, a process that starts), so on two cores three of them keep the cores busy.
DEFAULT_WORKERS = max(2, min(4, (os.cpu_count() or 2) + 1))
SLOWEST = 25
# A phase that runs longer than this is stopped and fails: pytest-xdist's --dist loadgroup
# can wait forever once a worker process has died (its finished work goes back on the
# queue as empty units: pytest-dev/pytest-xdist#1378, open in 3.8.0); a quiet run of the
# whole suite takes about 13 minutes here, CI allows 90
PHASE_LIMIT_S = 45 * 60


@dataclass
class Phase:
    """One pytest run of the suite: its name, its exit status, its wall time."""

    name: str
    args: list[str]
    junit: Path
    status: int | None = None
    seconds: float = 0.0
    busy: float = 0.0  # the machine's CPUs, busy over the phase: 0..1 (all of them)
    times: dict[str, float] = field(default_factory=dict)  # test id -> seconds

    def run(self, pytest_args: list[str], paths: list[str]) -> None:
        cmd = [sys.executable, "-m", "pytest", *self.args, f"--junitxml={self.junit}",
               *pytest_args, *paths]
        print(f"\n== {self.name}: {' '.join(cmd[1:])}", flush=True)
        self.junit.unlink(missing_ok=True)
        if not paths:
            self.status = 5  # nothing of this phase's kind among the paths
            print(f"{self.name}: no test of its kind here", flush=True)
            return
        t0, cpu0 = time.monotonic(), psutil.cpu_times()
        # conftest.GroupPool.record writes there how often it started the shared kernel (not
        # an RPCNB_ name: %rpc_doctor flags one that rpcnb does not read)
        proc = subprocess.Popen(cmd, cwd=ROOT, env=dict(os.environ,
                                                         TEST_SUITE_RESULTS=str(RESULTS)))
        try:
            self.status = proc.wait(timeout=PHASE_LIMIT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            self.status = 2
            print(f"\n{self.name}: stopped after {PHASE_LIMIT_S // 60} minutes (a test worker "
                  "that died leaves pytest-xdist waiting; see the failures above)", flush=True)
        self.seconds = time.monotonic() - t0
        cpu1 = psutil.cpu_times()
        total = sum(cpu1) - sum(cpu0)
        idle = (cpu1.idle + cpu1.iowait) - (cpu0.idle + cpu0.iowait)
        self.busy = 1 - idle / total if total > 0 else 0.0
        self.times = read_times(self.junit)

    @property
    def passed(self) -> bool:
        return self.status == 0


def serial_paths(paths: list[str]) -> list[str]:
    """Of ``paths`` (folders, files, node ids), those in files that mark a test ``serial``:
    the serial phase collects only these (collecting every test module, which imports
    torch and the rest, took 15 of its 90 seconds)."""
    found = []
    for path in paths:
        file = Path(path.split("::", 1)[0])
        file = file if file.is_absolute() else ROOT / file
        files = sorted(file.rglob("test_*.py")) if file.is_dir() else [file]
        marked = [f for f in files if f.is_file() and "mark.serial" in f.read_text()]
        if file.is_dir():
            found += [str(f.relative_to(ROOT)) if f.is_relative_to(ROOT) else str(f)
                      for f in marked]
        elif marked:
            found.append(path)
    return found


def read_times(junit: Path) -> dict[str, float]:
    """Each test's time (setup, call and teardown) from a JUnit XML file."""
    if not junit.exists():
        return {}
    times = {}
    for case in ET.parse(junit).iter("testcase"):
        path = case.get("classname", "").replace(".", "/")
        name = case.get("name", "").rsplit("@", 1)[0]  # xdist's "@group" suffix
        times[f"{path}.py::{name}"] = float(case.get("time") or 0)
    return times


def report(phases: list[Phase], wall: float) -> str:
    times = {test: s for phase in phases for test, s in phase.times.items()}
    lines = [f"{phase.name}: {phase.seconds:.0f} s, exit status {phase.status} "
             f"({len(phase.times)} tests; CPUs {phase.busy:.0%} busy)" for phase in phases]
    lines.append(f"wall time: {wall:.0f} s ({wall / 60:.1f} min)")
    lines.append(f"slowest {SLOWEST} tests (setup + call + teardown):")
    for test, s in sorted(times.items(), key=lambda kv: -kv[1])[:SLOWEST]:
        lines.append(f"  {s:7.1f} s  {test}")
    return "\n".join(lines)


def kernel_report() -> str:
    """How often the test processes started their shared kernel (tests/conftest.py's
    ``GroupPool``), and why one was stopped before the end: a test whose group could not
    be reset, a member that died. Each such start costs about 5 s of CPU."""
    files = sorted(RESULTS.glob("shared-kernel-*.txt"))
    if not files:
        return ""
    starts, stops = 0, []
    for file in files:
        first, *rest = file.read_text().splitlines() or ["starts 0"]
        starts += int(first.split()[1])
        stops += rest
    lines = [f"shared kernels: {starts} started in {len(files)} test processes, "
             f"{len(stops)} of them stopped before the end" + (":" if stops else "")]
    lines += [f"  {why}" for why in stops[:SLOWEST]]
    if len(stops) > SLOWEST:
        lines.append(f"  ... and {len(stops) - SLOWEST} more")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fast", action="store_true", help="make test-fast's selection")
    ap.add_argument("-n", "--workers", type=int, default=DEFAULT_WORKERS,
                    help=f"parallel workers of the first phase (default {DEFAULT_WORKERS})")
    ap.add_argument("paths", nargs="*", help="tests to run (default: tests/)")
    args, extra = ap.parse_known_args(argv)
    paths = args.paths or (FAST if args.fast else ["tests"])
    RESULTS.mkdir(exist_ok=True)
    for old in RESULTS.glob("shared-kernel-*.txt"):
        old.unlink()
    common = ["-q", "-p", "no:cacheprovider", *extra]
    # a test worker that dies is not replaced: the crash is reported as the failure of the
    # test it ran, the others finish the run (a replaced worker can leave loadgroup waiting)
    parallel = ["-n", str(args.workers), "--dist", "loadgroup", "--max-worker-restart", "0"] \
        if args.workers > 1 else []
    phases = [Phase("parallel phase", [*parallel, "-m", "not serial"],
                    RESULTS / "parallel.xml"),
              Phase("serial phase", ["-m", "serial"], RESULTS / "serial.xml")]
    t0 = time.monotonic()
    for phase, where in zip(phases, (paths, serial_paths(paths)), strict=True):
        phase.run(common, where)
    for phase, other in (phases, phases[::-1]):
        if phase.status == 5 and other.status not in (5, None):
            phase.status = 0  # no test of this phase's kind; the other phase had tests
    wall = time.monotonic() - t0
    times = {test: s for phase in phases for test, s in phase.times.items()}
    (RESULTS / "durations.txt").write_text("".join(
        f"{s:8.2f}  {test}\n" for test, s in sorted(times.items(), key=lambda kv: -kv[1])))
    print("\n" + report(phases, wall), flush=True)
    kernels = kernel_report()
    if kernels:
        print(kernels, flush=True)
    failed = [phase.name for phase in phases if not phase.passed]
    if failed:
        print(f"FAILED: {', '.join(failed)} (each phase's failures are listed above)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
