"""Build the documentation site: execute the tutorials, stage the sources, run Sphinx.

1. Executes every notebook in ``notebooks/`` headless (nbclient, kernel ``python3``, which
   jupyter_client starts with this interpreter) into ``<build>/notebooks/``. The notebooks
   start real worker processes; each must end with ``%rpc_shutdown``, and any process of
   the kernel's that outlives it is killed by pid.
2. Stages ``docs/`` (without ``_build``) in ``<build>/src`` with the notebooks under
   ``tutorials/``: the executed copies, or with ``--no-execute`` the stored ones, which
   have no outputs (what ``tests/test_docs.py`` builds, quickly). A notebook's links to
   ``../docs/X.md`` become ``../X.md``, where the site has those pages.
3. Runs ``sphinx-build -W --keep-going -E`` on the staged tree into ``<build>/html``.
   myst-nb renders the notebooks as they are (``nb_execution_mode = "off"`` in conf.py).

``<build>`` is ``docs/_build`` unless ``--build-dir`` says otherwise. Run it with the
project's interpreter (``make docs``, or ``.venv/bin/python scripts/build_docs.py``).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from rpcnb.launch import descendants as children_of
from rpcnb.launch import pid_alive

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
NOTEBOOKS = ROOT / "notebooks"
CELL_TIMEOUT = 300  # seconds per cell
GRACE = 5.0  # seconds the kernel's processes get to exit after it has shut down
LAST_CELL = "%rpc_shutdown"
DOCS_LINK = re.compile(r"\]\(\.\./docs/")


def _wait_gone(pids: set[int], grace: float) -> list[int]:
    deadline = time.monotonic() + grace
    left = sorted(p for p in pids if pid_alive(p))
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = [p for p in left if pid_alive(p)]
    return left


def execute(path: Path, dest: Path) -> float:
    """Run the notebook at ``path`` in a fresh kernel and write it, with its outputs, to
    ``dest``; the seconds it took. Raises RuntimeError if a cell failed or the notebook
    does not end with %rpc_shutdown."""
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    if not code or code[-1].source.strip() != LAST_CELL:
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
    nbformat.write(nb, dest)
    return seconds


def site_links(text: str) -> str:
    """Links from a notebook to the docs as they read in the site: a notebook links
    ``../docs/channels.md`` (right in the repository), the site has it at ``../channels.md``
    (the tutorials are staged one folder below the docs)."""
    return DOCS_LINK.sub(r"](../", text)


def stage(src: Path, notebooks: list[Path]) -> None:
    """docs/ without its build output, and the notebooks under tutorials/."""
    import nbformat

    if src.exists():
        shutil.rmtree(src)
    shutil.copytree(DOCS, src, ignore=shutil.ignore_patterns(
        "_build", ".ipynb_checkpoints", "__pycache__"))
    (src / "tutorials").mkdir(exist_ok=True)
    for path in notebooks:
        nb = nbformat.read(path, as_version=4)
        for cell in nb.cells:
            if cell.cell_type == "markdown":
                cell.source = site_links(cell.source)
        nbformat.write(nb, src / "tutorials" / path.name)


def sphinx(src: Path, out: Path, doctrees: Path) -> int:
    cmd = [sys.executable, "-m", "sphinx", "-b", "html", "-W", "--keep-going", "-E", "-q",
           "-d", str(doctrees), str(src), str(out)]
    return subprocess.call(cmd)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--no-execute", action="store_true",
                        help="render the notebooks as stored (no outputs); no kernel starts")
    parser.add_argument("--build-dir", type=Path, default=DOCS / "_build",
                        help="where src/, notebooks/, doctrees/ and html/ go (docs/_build)")
    args = parser.parse_args(argv)
    build = args.build_dir.resolve()
    sources = sorted(NOTEBOOKS.glob("*.ipynb"))
    started = time.monotonic()

    if args.no_execute:
        rendered = sources
    else:
        rendered = []
        for path in sources:
            dest = build / "notebooks" / path.name
            print(f"executing {path.relative_to(ROOT)} ...", flush=True)
            try:
                seconds = execute(path, dest)
            except RuntimeError as exc:
                print(f"docs: {exc}", file=sys.stderr)
                return 1
            print(f"  {seconds:.1f} s -> {dest}", flush=True)
            rendered.append(dest)

    stage(build / "src", rendered)
    print(f"sphinx-build -W: {build / 'src'} -> {build / 'html'}", flush=True)
    rc = sphinx(build / "src", build / "html", build / "doctrees")
    elapsed = time.monotonic() - started
    if rc != 0:
        print(f"docs: sphinx-build failed (exit {rc}); the warnings above are errors here",
              file=sys.stderr)
        return rc
    print(f"docs built in {elapsed:.0f} s: {build / 'html' / 'index.html'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
