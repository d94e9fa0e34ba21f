"""The documented commands run as documented (`python -m rpcnb.worker`, `python -m
rpcnb.netns`): real processes, each stopped by its pid when the test ends."""

from __future__ import annotations

import subprocess
import sys


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    proc = subprocess.Popen([sys.executable, "-m", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
        proc.wait()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def test_the_worker_command_says_how_to_join():
    done = _run("rpcnb.worker", "--help")
    assert done.returncode == 0, done.stderr
    assert "--join" in done.stdout and "Join a running rpcnb group" in done.stdout


def test_the_netns_command_says_its_usage():
    done = _run("rpcnb.netns")
    assert done.returncode == 2
    assert "usage: python -m rpcnb.netns run -- CMD" in done.stderr
