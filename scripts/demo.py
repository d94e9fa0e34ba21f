"""Run the quickstart notebook headless and print what each cell showed.

Executes ``notebooks/01_quickstart.ipynb`` in a fresh ``python3`` kernel with nbclient,
prints every code cell's output, saves the executed copy under ``build/demo/`` (the
committed ones in ``notebooks/executed/`` are ``make tutorials``'s), and fails if a cell
raised or if a worker process outlived the kernel.

Run it with the project's interpreter (``.venv/bin/python scripts/demo.py``, or
``make demo``): jupyter_client starts the ``python3`` kernel with ``sys.executable``.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import time
from pathlib import Path
from typing import Any

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK = ROOT / "notebooks" / "01_quickstart.ipynb"
EXECUTED = ROOT / "build" / "demo" / "01_quickstart.ipynb"
CELL_TIMEOUT = 120  # seconds per cell
WORKER_MARK = b"from rpcnb.worker import main"
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _boot_time() -> float:
    with open("/proc/stat") as f:
        for line in f:
            if line.startswith("btime "):
                return float(line.split()[1])
    raise RuntimeError("no btime in /proc/stat")


def _start_time(pid: str, btime: float, ticks: int) -> float:
    """Wall-clock start time of a process, from /proc/PID/stat."""
    with open(f"/proc/{pid}/stat") as f:
        stat = f.read()
    fields = stat[stat.rindex(")") + 2:].split()  # the command name may hold spaces
    return btime + int(fields[19]) / ticks  # field 22 of stat: starttime in clock ticks


def workers_started_since(since: float, parent: int | None = None) -> list[int]:
    """Pids of rpcnb worker processes that started at or after ``since`` (time.time()).

    With ``parent``, only the workers that kernel started (their ``--parent-pid``), so a
    test run going on beside the demo keeps its workers.
    """
    btime = _boot_time()
    ticks = os.sysconf("SC_CLK_TCK")
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
            if WORKER_MARK not in cmdline:
                continue
            args = cmdline.split(b"\0")
            if parent is not None and str(parent).encode() not in _after(args, b"--parent-pid"):
                continue
            # one tick of slack: start times are rounded down to clock ticks
            if _start_time(pid, btime, ticks) >= since - 1.0 / ticks:
                found.append(int(pid))
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue  # it exited while we looked
    return found


def wait_gone(since: float, parent: int | None, grace: float) -> list[int]:
    """Wait up to ``grace`` seconds for those workers to exit; return the ones left."""
    deadline = time.monotonic() + grace
    left = workers_started_since(since, parent)
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = workers_started_since(since, parent)
    return left


def _after(args: list[bytes], flag: bytes) -> list[bytes]:
    return [args[i + 1] for i, a in enumerate(args[:-1]) if a == flag]


def _text(output: Any) -> str:
    kind = output.get("output_type")
    if kind == "stream":
        return output.get("text", "")
    if kind in ("execute_result", "display_data"):
        return output.get("data", {}).get("text/plain", "") + "\n"
    if kind == "error":  # the traceback as IPython rendered it (remote ones included)
        lines = output.get("traceback") or [f"{output.get('ename')}: {output.get('evalue')}"]
        return _ANSI.sub("", "\n".join(lines)) + "\n"
    return ""


def show(nb: Any) -> int:
    """Print each code cell's first line and its outputs; return the number of errors."""
    errors = 0
    n = 0
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        n += 1
        first = cell.source.splitlines()[0] if cell.source else ""
        print(f"\n[{n}] {first}")
        for output in cell.get("outputs", []):
            if output.get("output_type") == "error":
                errors += 1
            text = _text(output)
            if text:
                print("    " + text.rstrip("\n").replace("\n", "\n    "))
    return errors


def main() -> int:
    started = time.time()
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = NotebookClient(nb, timeout=CELL_TIMEOUT, kernel_name="python3",
                            resources={"metadata": {"path": str(ROOT)}})
    kernel: dict[str, Any] = {"pid": None, "exe": None}

    def remember_kernel(**_: Any) -> None:
        provisioner = getattr(client.km, "provisioner", None)
        kernel["pid"] = getattr(provisioner, "pid", None)
        if kernel["pid"] is not None:
            # argv[0], not /proc/PID/exe: a venv's python is a symlink to the base one
            try:
                with open(f"/proc/{kernel['pid']}/cmdline", "rb") as f:
                    kernel["exe"] = f.read().split(b"\0")[0].decode()
            except OSError:
                pass

    last_code = max(i for i, c in enumerate(nb.cells) if c.cell_type == "code")
    after_last_cell: list[int] = []

    def check_workers_gone(cell_index: int, **_: Any) -> None:
        # The last cell is %rpc_shutdown: its workers must be gone while the kernel lives.
        if cell_index == last_code:
            after_last_cell.extend(wait_gone(started, kernel["pid"], grace=1.0))

    client.on_notebook_start = remember_kernel
    client.on_cell_executed = check_workers_gone
    print(f"running {NOTEBOOK.relative_to(ROOT)} with {sys.executable}")
    failure = ""
    try:
        client.execute()  # starts a fresh kernel and shuts it down afterwards
    except CellExecutionError as exc:
        failure = str(exc).strip().splitlines()[-1] if str(exc).strip() else repr(exc)
    except Exception as exc:  # a timeout or a dead kernel: still show what ran
        failure = f"{type(exc).__name__}: {exc}"
    elapsed = time.time() - started

    errors = show(nb)
    EXECUTED.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, EXECUTED)
    print(f"\nexecuted notebook: {EXECUTED.relative_to(ROOT)} ({elapsed:.1f} s; "
          f"kernel pid {kernel['pid']}, {kernel['exe']})")

    # The kernel is gone too; its workers watch it and exit within a second.
    left = wait_gone(started, kernel["pid"], grace=3.0)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    ok = True
    if kernel["exe"] and kernel["exe"] != sys.executable:
        print(f"FAILED: the kernel ran {kernel['exe']}, not {sys.executable}", file=sys.stderr)
        ok = False
    if failure or errors:
        print(f"FAILED: {errors} cell(s) raised. {failure}".rstrip(), file=sys.stderr)
        ok = False
    if after_last_cell:
        print(f"FAILED: worker processes still running after the last cell: {after_last_cell}",
              file=sys.stderr)
        ok = False
    if left:
        print(f"FAILED: worker processes outlived the kernel (killed): {left}", file=sys.stderr)
        ok = False
    if ok:
        print("demo ok: every cell ran, no worker process left behind")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
