"""Execute the tutorials into ``notebooks/executed/``: the copies with outputs and figures
that a repository browser renders and the documentation site publishes.

``make tutorials`` (or ``.venv/bin/python scripts/tutorials.py [NAME ...]``) runs each
notebook of ``notebooks/`` top to bottom in a fresh ``python3`` kernel (nbclient; that
kernel runs this interpreter) and writes it, outputs included, to ``notebooks/executed/``.
The copies are committed: run it again after changing a tutorial, and commit them with it
(``tests/kernel/test_notebooks.py`` fails on a copy whose code differs from its source).

To keep the copies small and their diffs readable, a copy keeps no per-cell timing and no
widget state (a widget shows its text form), and the checkout's path in outputs reads
``<repo>``. ``--check`` only lists the copies that are missing or stale (exit 1 if any),
starting no kernel.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from rpcnb.procs.processes import descendants as children_of
from rpcnb.procs.processes import pid_alive

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
EXECUTED = NOTEBOOKS / "executed"
CELL_TIMEOUT = 300  # seconds per cell
GRACE = 5.0  # seconds the kernel's processes get to exit after it has shut down
LAST_CELL = "%rpc_shutdown"
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
STALE = "{name}: {why}; run `make tutorials` and commit notebooks/executed/"


def sources() -> list[Path]:
    return sorted(NOTEBOOKS.glob("*.ipynb"))


def code_cells(nb: Any) -> list[str]:
    return [c.source for c in nb.cells if c.cell_type == "code"]


def stale(source: Path, executed: Path | None = None) -> str | None:
    """Why the executed copy of ``source`` is not current (missing, or its code cells
    differ from the source's), or None when it is."""
    import nbformat

    executed = executed or EXECUTED / source.name
    if not executed.exists():
        return STALE.format(name=source.name, why=f"no executed copy in {EXECUTED.name}/")
    if code_cells(nbformat.read(executed, as_version=4)) != code_cells(
            nbformat.read(source, as_version=4)):
        return STALE.format(name=source.name, why="the executed copy's code differs")
    return None


def _wait_gone(pids: set[int], grace: float) -> list[int]:
    deadline = time.monotonic() + grace
    left = sorted(p for p in pids if pid_alive(p))
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = [p for p in left if pid_alive(p)]
    return left


def execute(path: Path, dest: Path) -> float:
    """Run the notebook at ``path`` in a fresh kernel and write it, with its outputs, to
    ``dest``, tidied (:func:`tidy`); the seconds it took. Raises RuntimeError if a cell failed or the notebook
    does not end with %rpc_shutdown. Processes of the kernel's that outlive it are killed
    by pid."""
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    code = code_cells(nb)
    if not code or code[-1].strip() != LAST_CELL:
        raise RuntimeError(f"{path.name}: the last code cell must be {LAST_CELL} (it stops "
                           "the workers the notebook started)")
    client = NotebookClient(nb, timeout=CELL_TIMEOUT, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}})
    kernel: dict[str, Any] = {"pid": None}
    seen: set[int] = set()
    stop = threading.Event()

    def on_start(**_: Any) -> None:
        pid = getattr(client.km.provisioner, "pid", None)
        kernel["pid"] = pid
        if pid is not None:  # argv[0]: a venv's python is a symlink to the base one
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                exe = f.read().split(b"\0")[0].decode()
            if exe != sys.executable:
                raise RuntimeError(f"the python3 kernel runs {exe}, not {sys.executable}")

    def watch() -> None:  # workers may start and exit between two looks
        while not stop.wait(0.2):
            if kernel["pid"] is not None:
                seen.update(children_of(kernel["pid"]))

    client.on_notebook_start = on_start
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    started = time.monotonic()
    try:
        client.execute()  # a fresh kernel, shut down afterwards
    except Exception as exc:
        raise RuntimeError(f"{path.name} failed: {exc}") from None
    finally:
        stop.set()
        watcher.join()
        if kernel["pid"] is not None:
            seen.update({kernel["pid"], *children_of(kernel["pid"])})
        left = _wait_gone(seen, GRACE)
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if left:
            print(f"warning: {path.name} left processes behind; killed {left}", file=sys.stderr)
    seconds = time.monotonic() - started
    dest.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(tidy(nb), dest)
    return seconds


def tidy(nb: Any) -> Any:
    """The executed notebook as committed: no widget state or widget views (their text
    form stays), no per-cell timings, the checkout's path as ``<repo>``."""
    nb.metadata.pop("widgets", None)
    root = str(ROOT)
    for cell in nb.cells:
        cell.metadata.pop("execution", None)
        if cell.cell_type != "code":
            continue
        cell.outputs = [o for o in cell.outputs if set(o.get("data", {"": 0})) != {WIDGET_VIEW}]
        for output in cell.outputs:
            data = output.get("data")
            if data is not None:
                data.pop(WIDGET_VIEW, None)
                for mime in ("text/plain", "text/html"):
                    if isinstance(data.get(mime), str):
                        data[mime] = data[mime].replace(root, "<repo>")
            if isinstance(output.get("text"), str):
                output["text"] = output["text"].replace(root, "<repo>")
            if output.get("output_type") == "error":
                output["traceback"] = [t.replace(root, "<repo>") for t in output["traceback"]]
    return nb


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("names", nargs="*", help="notebooks to run (stem or file name); all "
                        "by default")
    parser.add_argument("--check", action="store_true",
                        help="list the missing or stale copies (exit 1 if any); runs nothing")
    args = parser.parse_args(argv)
    chosen = sources()
    if args.names:
        wanted = {Path(n).stem for n in args.names}
        unknown = wanted - {p.stem for p in chosen}
        if unknown:
            print(f"tutorials: no such notebook in notebooks/: {', '.join(sorted(unknown))}",
                  file=sys.stderr)
            return 2
        chosen = [p for p in chosen if p.stem in wanted]

    if args.check:
        problems = [why for why in map(stale, chosen) if why]
        for why in problems:
            print(why)
        if not problems:
            print(f"{len(chosen)} executed tutorials are current")
        return 1 if problems else 0

    started = time.monotonic()
    for path in chosen:
        dest = EXECUTED / path.name
        print(f"executing {path.relative_to(ROOT)} ...", flush=True)
        try:
            seconds = execute(path, dest)
        except RuntimeError as exc:
            print(f"tutorials: {exc}", file=sys.stderr)
            return 1
        print(f"  {seconds:.1f} s -> {dest.relative_to(ROOT)} "
              f"({dest.stat().st_size // 1024} KB)", flush=True)
    print(f"{len(chosen)} tutorials executed in {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
