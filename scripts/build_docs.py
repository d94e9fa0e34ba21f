"""Build the documentation site: the executed tutorials, the sources staged, Sphinx.

1. Takes each tutorial's executed copy, with its outputs and figures, from
   ``notebooks/executed/`` (committed, written by ``make tutorials``) when it is current:
   same code cells as the notebook. A missing or stale copy is executed afresh into
   ``<build>/notebooks/`` (``scripts/tutorials.py``: nbclient, kernel ``python3``, which
   jupyter_client starts with this interpreter; any process of the kernel's that
   outlives it is killed by pid), and so is every notebook with ``--execute``.
   With ``--no-execute`` no kernel starts: a missing or stale copy is replaced by the
   stored notebook, which has no outputs (what ``tests/build/test_docs.py`` builds, quickly).
2. Stages ``docs/`` (without ``_build``) in ``<build>/src`` with those notebooks under
   ``tutorials/``. A notebook's links to
   ``../docs/X.md`` become ``../X.md``, where the site has those pages. The staged
   ``magics.md`` gets its flag tables from the magics' parsers (``scripts/magic_flags.py``),
   so the site lists the flags the code has, and the staged ``benchmarks.md`` its table from
   the bench JSON files (``scripts/bench_table.py``); where a committed page differs, the
   build says so (``tests/unit/test_docs_flags.py`` and ``tests/unit/test_bench_table.py``
   fail on it).
3. Runs ``sphinx-build -W --keep-going -E`` on the staged tree into ``<build>/html``.
   myst-nb renders the notebooks as they are (``nb_execution_mode = "off"`` in conf.py).

``<build>`` is ``docs/_build`` unless ``--build-dir`` says otherwise. Run it with the
project's interpreter (``make docs``, or ``.venv/bin/python scripts/build_docs.py``).
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import bench_table
import magic_flags
import settings_table
from tutorials import EXECUTED, execute, sources, stale

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
DOCS_LINK = re.compile(r"\]\(\.\./docs/")


def site_links(text: str) -> str:
    """Links from a notebook to the docs as they read in the site: a notebook links
    ``../docs/channels.md`` (right in the repository), the site has it at ``../channels.md``
    (the tutorials are staged one folder below the docs)."""
    return DOCS_LINK.sub(r"](../", text)


def stage(src: Path, notebooks: list[Path]) -> None:
    """docs/ without its build output, its flag tables from the parsers, the benchmark table
    from the JSON files, and the notebooks under tutorials/."""
    import nbformat

    if src.exists():
        shutil.rmtree(src)
    shutil.copytree(DOCS, src, ignore=shutil.ignore_patterns(
        "_build", ".ipynb_checkpoints", "__pycache__"))
    if magic_flags.write(src / "magics.md"):
        print("docs: docs/magics.md's flag tables differ from the parsers (the site gets the "
              "parsers'); `python scripts/magic_flags.py` rewrites them", flush=True)
    if bench_table.write(src / "benchmarks.md"):
        print("docs: docs/benchmarks.md's table differs from the bench JSON files (the site gets "
              "the JSON's); `python scripts/bench_table.py` rewrites it", flush=True)
    if settings_table.write(src / "settings.md"):
        print("docs: docs/settings.md's variables differ from rpcnb.settings (the site gets "
              "rpcnb.settings'); `python scripts/settings_table.py` rewrites them", flush=True)
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
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--no-execute", action="store_true",
                      help="start no kernel: a notebook without a current executed copy is "
                      "rendered as stored (no outputs)")
    mode.add_argument("--execute", action="store_true",
                      help="execute every notebook, also those with a current copy in "
                      "notebooks/executed/")
    parser.add_argument("--build-dir", type=Path, default=DOCS / "_build",
                        help="where src/, notebooks/, doctrees/ and html/ go (docs/_build)")
    args = parser.parse_args(argv)
    build = args.build_dir.resolve()
    started = time.monotonic()

    rendered = []
    for path in sources():
        why = None if args.execute else stale(path)
        if not args.execute and why is None:
            rendered.append(EXECUTED / path.name)
            continue
        if why:
            print(f"docs: {why}", flush=True)
        if args.no_execute:
            rendered.append(path)
            continue
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
