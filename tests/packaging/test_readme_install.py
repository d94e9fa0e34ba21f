"""The README's Install section, followed as written in a fresh virtual environment: the
CPU torch line, the rpcnb line (``pip install 'rpcnb[lab]'``: this rpcnb is not on PyPI,
so the wheel that test_wheel builds from the tracked files without Node.js, with its lab
extra, which is what PyPI would give), then JupyterLab runs with the panel and the kernels
there."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from test_wheel import built_without_node, without_node

ROOT = Path(__file__).resolve().parents[2]
# This machine reaches PyPI but not download.pytorch.org; its pip has the CPU wheel of
# torch 2.13.0 on local disk (and, newer, CUDA builds of several GB). The CPU line's index
# is unreachable here, so pip takes what the local sources have: pinned to the CPU build.
LOCAL_CPU_TORCH = "torch==2.13.0"


def install_lines() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Install", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```\n(.*?)```", section, re.S)
    assert block, "the Install section has no command block"
    return [ln.strip() for ln in block.group(1).splitlines() if ln.strip()]


def test_the_install_section_says_what_a_user_needs():
    lines = install_lines()
    assert lines == [
        "pip install torch --index-url https://download.pytorch.org/whl/cpu",
        "pip install torch",
        "pip install 'rpcnb[lab]'",
        "jupyter lab",
    ], lines
    section = (ROOT / "README.md").read_text().split("## Install", 1)[1]
    assert "pip install '.[lab]'" in section  # the same from a clone


pytestmark = pytest.mark.xdist_group("packaging")  # with test_wheel: its wheel, built once


# pip installs torch, JupyterLab and the rest into a fresh venv: 126 s on two quiet cores,
# the wheel's build included; more under the suite's load
@pytest.mark.timeout(600)
def test_the_install_section_works_in_a_fresh_venv(tmp_path, tmp_path_factory):
    if os.environ.get("RPCNB_SKIP_INSTALL_TEST") == "1":
        pytest.skip("RPCNB_SKIP_INSTALL_TEST=1")
    built = built_without_node(tmp_path_factory)
    assert built.done.returncode == 0, built.done.stderr[-3000:]
    (wheel,) = built.out.glob("rpcnb-*.whl")
    src = tmp_path / "here"  # where the commands run: not a clone, so pip takes the wheel
    src.mkdir()
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    bin_ = venv / "bin"
    constraints = tmp_path / "constraints.txt"
    machine = Path("/etc/xdg/pip/constraints.txt")
    constraints.write_text((machine.read_text() if machine.exists() else "") +
                           f"\n{LOCAL_CPU_TORCH}\n")
    # PIP_NO_COMPILE: pip leaves the .pyc files to the first import (byte-compiling torch's
    # and JupyterLab's thousands of modules was CPU time the two cores lacked for the rest
    # of the suite; what the README's lines install is the same)
    env = dict(os.environ, PATH=f"{bin_}{os.pathsep}{os.environ['PATH']}",
               VIRTUAL_ENV=str(venv), PIP_CONSTRAINT=str(constraints), PIP_NO_COMPILE="1")
    env.pop("PYTHONPATH", None)
    cpu, _cuda, rpcnb_line, lab = install_lines()

    def sh(line: str, timeout: float = 900) -> subprocess.CompletedProcess:
        # as on a machine without Node.js (where root can hide it; else with it)
        if os.geteuid() == 0:
            done = without_node(f"cd {src} && {line}", timeout=timeout, env=env)
        else:
            done = subprocess.run(line, shell=True, cwd=src, env=env, capture_output=True,
                                  text=True, timeout=timeout)
        assert done.returncode == 0, f"{line}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        return done

    sh(cpu.replace("pip install", "pip install --retries 1"))
    sh(rpcnb_line.replace("'rpcnb[lab]'", f"'{wheel}[lab]'"))
    assert lab == "jupyter lab"
    sh("jupyter lab --version")  # installed: the README's next step can start it
    exts = sh("jupyter labextension list")
    listed = re.sub(r"\x1b\[[0-9;]*m", "", exts.stdout + exts.stderr)
    # prebuilt, installed by pip: its install.json names the Python package
    assert re.search(r"rpcnb v[\d.]+ enabled OK \(python, rpcnb\)", listed), listed
    kernels = sh("jupyter kernelspec list")
    assert re.search(r"^\s*rpcnb\s", kernels.stdout, re.M), kernels.stdout
    version = sh("python -c 'import rpcnb, torch; print(rpcnb.__version__, torch.__version__)'")
    assert version.stdout.split()[0] == "0.1.0" and "+cpu" in version.stdout
    page = sh("python -m rpcnb.docs security")
    assert page.stdout.startswith("# Security")
