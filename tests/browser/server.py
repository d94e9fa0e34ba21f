"""JupyterLab for the browser tests, and the steps every test takes in it with Chromium.

``LabServer`` is one JupyterLab on 127.0.0.1 with a token, kept for the test session
(conftest.py's ``lab_server``). Each test gets a clean start in it (``begin``): a folder of
its own for its notebooks and a JupyterLab workspace of its own (no tab or panel of an
earlier test comes back), and at its end (``end``) every session and kernel in the server is
shut down through its REST API (``/api/sessions``, ``/api/kernels``) and every process they
started is stopped by pid. Its kernels get a private rpcnb runtime folder of the session's
(``RPCNB_RUNTIME_DIR``: the namespace holder of its `rpcnb` kernels, their sockets, the
registry of kept groups), so that no kept group or holder of the machine's user shows in a
test, and none of a test's outlives the session. Without Chromium the tests skip and say
why; under CI (CI=true) they fail instead.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import secrets
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from pids import Seen

from rpcnb.procs.processes import descendants
from rpcnb.sandbox import netns

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
DOCS_STATIC = Path(__file__).resolve().parents[2] / "docs" / "_static"
NO_CHROMIUM = (
    "Debian's Chromium is not installed at /usr/bin/chromium: run `make test` as root "
    "(it installs it with apt-get), or apt-get install -y chromium."
)
KERNELS = {"python3": "Python 3", "rpcnb": "Python 3 (rpcnb)"}
START_TIMEOUT = 90  # seconds for JupyterLab to answer /api/status
GRACE = 5.0  # seconds killed processes get to be gone


def browser_or_skip() -> None:
    if Path(CHROMIUM).exists():
        pytest.importorskip("playwright.sync_api")
        return
    if os.environ.get("CI") == "true":
        pytest.fail(NO_CHROMIUM)
    pytest.skip(NO_CHROMIUM)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def gone(seen: Seen, timeout: float = GRACE) -> list[int]:
    """The pids of the processes ``seen`` still alive after ``timeout`` seconds (SIGKILL is
    delivered asynchronously)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and seen.alive():
        time.sleep(0.05)
    return seen.alive()


class LabServer:
    """JupyterLab serving ``base/root``, its output in ``base/lab.log``; ``stop()`` stops it
    and everything it started, by pid."""

    def __init__(self, base: Path) -> None:
        self.port, self.token = free_port(), secrets.token_hex(16)
        self.url = f"http://127.0.0.1:{self.port}"
        self.root = base / "root"
        self.root.mkdir()
        self.log_path = base / "lab.log"
        self.rpcnb_runtime = base / "rpcnb-run"
        self.rpcnb_runtime.mkdir(mode=0o700)
        self._names = itertools.count(1)
        env = dict(os.environ, JUPYTER_RUNTIME_DIR=str(base / "runtime"),
                   JUPYTERLAB_SETTINGS_DIR=str(base / "settings"),
                   JUPYTERLAB_WORKSPACES_DIR=str(base / "workspaces"),
                   RPCNB_RUNTIME_DIR=str(self.rpcnb_runtime))
        cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", "--ServerApp.ip=127.0.0.1",
               f"--ServerApp.port={self.port}", "--ServerApp.port_retries=0",
               f"--IdentityProvider.token={self.token}", f"--ServerApp.root_dir={self.root}",
               "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"]
        if os.geteuid() == 0:
            cmd.append("--allow-root")
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        self.pid = self.proc.pid
        self.seen = Seen([self.pid])  # every process of the server's seen, stopped by stop()
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        self.own = Seen(descendants(self.pid))  # the server's own helpers, none of a test's

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            try:
                self.api("GET", "status", timeout=2)
                return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("JupyterLab did not start:\n"
                                       + self.log_path.read_text(errors="replace")[-3000:]) from None
                time.sleep(0.3)

    def api(self, method: str, path: str, timeout: float = 60) -> Any:
        """``method`` on the server's ``/api/<path>``; the JSON it answered, if any."""
        request = urllib.request.Request(f"{self.url}/api/{path}", method=method,
                                         headers={"Authorization": f"token {self.token}"})
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            body = resp.read()
        return json.loads(body) if body else None

    def begin(self, name: str) -> dict[str, Any]:
        """A clean start for the test ``name``: what its ``lab`` fixture gives it.

        ``url``, ``token``, ``pid`` (the server's); ``root``: the test's own folder, where
        it writes its notebooks (their kernels start there); ``path``: that folder in the
        server; ``workspace``: the test's own JupyterLab workspace; ``started``: pids the
        test saw its kernels start, stopped at its end with the rest; ``log()``: what the
        server wrote to its log since the test began; ``rpcnb_runtime``: the kernels'
        ``RPCNB_RUNTIME_DIR`` (the session's)."""
        folder = f"{next(self._names):02d}-{re.sub(r'[^A-Za-z0-9_.-]+', '_', name)}"[:80]
        (self.root / folder).mkdir()
        self.seen.update(descendants(self.pid))
        offset = self.log_path.stat().st_size

        def log() -> str:
            with open(self.log_path, "rb") as f:
                f.seek(offset)
                return f.read().decode(errors="replace")

        return {"url": self.url, "token": self.token, "pid": self.pid, "root": self.root / folder,
                "path": folder, "workspace": folder, "started": Seen(), "log": log,
                "rpcnb_runtime": self.rpcnb_runtime}

    def end(self, test: dict[str, Any]) -> tuple[list[int], list[str]]:
        """Shut down every session and kernel (the test's: tests take turns in one
        server), then stop by pid every process they started. Returns the pids still alive
        and the sessions or kernels the server still lists (both empty when it worked)."""
        started: Seen = test["started"]
        started.update(descendants(self.pid))
        left_over: list[str] = []
        try:
            for session in self.api("GET", "sessions"):
                self._shut("sessions", session["id"])
            for kernel in self.api("GET", "kernels"):
                self._shut("kernels", kernel["id"])
            left_over = [f"session {s['path']}" for s in self.api("GET", "sessions")] + \
                [f"kernel {k['id']} ({k['name']})" for k in self.api("GET", "kernels")]
        except OSError as exc:  # the server itself is gone: the pids below are all there is
            left_over = [f"the server did not answer: {exc}"]
        finally:
            started.update(descendants(self.pid))
            mine = started.since(self.own).only(lambda p: p != self.pid)
            self.seen |= mine
            mine.kill()
        return gone(mine), left_over

    def _shut(self, kind: str, ident: str) -> None:
        try:
            self.api("DELETE", f"{kind}/{ident}")
        except urllib.error.HTTPError as exc:
            if exc.code != 404:  # 404: gone already (a session's kernel, deleted with it)
                raise

    def stop(self) -> list[int]:
        """Stop the server and every process it started, the namespace holder of its
        `rpcnb` kernels included (a daemon of their runtime folder); the pids still alive."""
        self.seen.update(descendants(self.pid))
        holder = netns.find_holder(self.rpcnb_runtime)
        if holder is not None:
            self.seen.add(holder.pid)
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        self._log.close()
        self.seen.kill()
        return gone(self.seen)


# -- in the page ----------------------------------------------------------------------------


def write_notebook(path: Path, cells: list[str], kernel: str = "python3") -> None:
    """A notebook of these code cells, unrun, on this kernelspec."""
    nb = {
        "cells": [{"cell_type": "code", "execution_count": None, "metadata": {},
                   "outputs": [], "source": src} for src in cells],
        "metadata": {"kernelspec": {"name": kernel, "display_name": KERNELS[kernel],
                                    "language": "python"}},
        "nbformat": 4, "nbformat_minor": 5,
    }
    path.write_text(json.dumps(nb))


def open_notebook(page: Any, lab: dict[str, Any], name: str, kernel: str = "python3") -> None:
    """Open the test's notebook ``name`` in its own workspace of JupyterLab on ``page``,
    wait until its kernel is idle, and dismiss JupyterLab's "news?" toast (it would sit over
    the outputs)."""
    from playwright.sync_api import expect

    page.set_default_timeout(120_000)
    expect.set_options(timeout=120_000)  # a cold kernel and group take a while
    page.goto(f"{lab['url']}/lab/workspaces/{lab['workspace']}/tree/{lab['path']}/{name}"
              f"?token={lab['token']}")
    page.locator(".jp-Notebook .jp-Cell").first.wait_for()
    idle = "Python 3 (ipykernel) | Idle" if kernel == "python3" else f"{KERNELS[kernel]} | Idle"
    expect(page.get_by_text(idle)).to_be_visible()
    news = page.get_by_role("button", name="No", exact=True)
    if news.is_visible():
        news.click()


def run_cell(page: Any, index: int) -> None:
    """Run cell ``index`` (click into it, Shift+Enter) and wait until it has finished."""
    from playwright.sync_api import expect

    cell = page.locator(".jp-Notebook .jp-Cell").nth(index)
    cell.locator(".jp-InputArea-editor").click()
    page.keyboard.press("Shift+Enter")
    expect(cell.locator(".jp-InputPrompt")).to_have_text(re.compile(r"\[\d+\]"))
