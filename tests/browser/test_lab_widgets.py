"""The widgets in a real JupyterLab, driven by a real browser: JupyterLab served on
loopback with a token, Debian's Chromium driven by Playwright, a notebook that starts a
live group, probes it, shows the channel monitor and the device-map editor. Changing a
mapping in the editor changes the validation message. Screenshots go to the test's
tmp_path (and to docs/_static/ with RPCNB_UPDATE_SCREENSHOTS=1).

Without Chromium the test skips and says why; under CI (CI=true) it fails instead.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from conftest import children_of, kill_all, pid_alive

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
DOCS_STATIC = Path(__file__).resolve().parents[2] / "docs" / "_static"
NO_CHROMIUM = (
    "Debian's Chromium is not installed at /usr/bin/chromium: run `make test` as root "
    "(it installs it with apt-get), or apt-get install -y chromium."
)

CELLS = [
    "%load_ext rpcnb\n%rpc_init --workers 2",
    "%rpc_probe --sizes 1K,16K,256K,1M,8M --repeats 1",
    "import rpcnb\nfor _ in range(10):\n    rpcnb.run('worker1', '1 + 1')\n    rpcnb.run('worker2', '2 + 2')",
    "%rpc_channels",
    "%rpc_devmap --topology worker0=2,worker1=2,worker2=1",
    "%rpc_shutdown",
]


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


KERNELS = {"python3": "Python 3", "rpcnb": "Python 3 (rpcnb)"}


def write_notebook(path: Path, cells: list[str] = CELLS, kernel: str = "python3") -> None:
    """A notebook of these code cells, unrun, on this kernelspec."""
    nb = {
        "cells": [{"cell_type": "code", "execution_count": None, "metadata": {},
                   "outputs": [], "source": src} for src in cells],
        "metadata": {"kernelspec": {"name": kernel, "display_name": KERNELS[kernel],
                                    "language": "python"}},
        "nbformat": 4, "nbformat_minor": 5,
    }
    path.write_text(json.dumps(nb))


def open_notebook(page, lab, name: str, kernel: str = "python3") -> None:
    """Open ``name`` in JupyterLab on ``page``, wait until its kernel is idle, and dismiss
    JupyterLab's "news?" toast (it would sit over the outputs)."""
    from playwright.sync_api import expect

    page.set_default_timeout(120_000)
    expect.set_options(timeout=120_000)  # a cold kernel and group take a while
    page.goto(f"{lab['url']}/lab/tree/{name}?token={lab['token']}")
    page.locator(".jp-Notebook .jp-Cell").first.wait_for()
    idle = "Python 3 (ipykernel) | Idle" if kernel == "python3" else f"{KERNELS[kernel]} | Idle"
    expect(page.get_by_text(idle)).to_be_visible()
    news = page.get_by_role("button", name="No", exact=True)
    if news.is_visible():
        news.click()


@pytest.fixture
def lab(tmp_path):
    """JupyterLab on 127.0.0.1 with a token; it and everything it started stop by pid."""
    browser_or_skip()
    port, token = free_port(), secrets.token_hex(16)
    root = tmp_path / "lab"
    root.mkdir()
    env = dict(os.environ, JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"),
               JUPYTERLAB_SETTINGS_DIR=str(tmp_path / "settings"),
               JUPYTERLAB_WORKSPACES_DIR=str(tmp_path / "workspaces"))
    cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", "--ServerApp.ip=127.0.0.1",
           f"--ServerApp.port={port}", "--ServerApp.port_retries=0",
           f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}",
           "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"]
    if os.geteuid() == 0:
        cmd.append("--allow-root")
    log = open(tmp_path / "lab.log", "wb")
    server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    started = {server.pid}
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 90
        while True:
            try:
                with urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=2):
                    break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("JupyterLab did not start:\n"
                                       + (tmp_path / "lab.log").read_text()[-3000:]) from None
                time.sleep(0.3)
        yield {"url": url, "token": token, "root": root, "pid": server.pid,
               "started": started}
    finally:
        started.update(children_of(server.pid))
        server.terminate()
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(5)
        log.close()
        time.sleep(0.2)
        kill_all(sorted(p for p in started if pid_alive(p)))


def run_cell(page, index: int) -> None:
    """Run cell ``index`` (click into it, Shift+Enter) and wait until it has finished."""
    from playwright.sync_api import expect

    cell = page.locator(".jp-Notebook .jp-Cell").nth(index)
    cell.locator(".jp-InputArea-editor").click()
    page.keyboard.press("Shift+Enter")
    expect(cell.locator(".jp-InputPrompt")).to_have_text(re.compile(r"\[\d+\]"))


def test_monitor_and_editor_in_jupyterlab(lab, tmp_path):
    from playwright.sync_api import expect, sync_playwright

    write_notebook(lab["root"] / "channels.ipynb")
    shots = tmp_path / "screenshots"
    shots.mkdir()
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        lab["started"].update(children_of(os.getpid()))
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1100})
            open_notebook(page, lab, "channels.ipynb")
            for i in range(5):
                run_cell(page, i)
                assert page.locator(".jp-Notebook .jp-Cell").nth(i) \
                    .locator(".jp-OutputArea-output[data-mime-type*='stderr']") \
                    .filter(has_text="Error").count() == 0, f"cell {i} failed"
            lab["started"].update(children_of(lab["pid"]))

            # the channel monitor, with real data from the live group
            monitor = page.locator(".rpcnb-monitor")
            expect(monitor).to_be_visible()
            expect(monitor.locator("td.rpcnb-cell")).to_have_count(6)
            cell = monitor.locator("td[data-pair='worker1->worker2']")
            expect(cell.locator(".rpcnb-path")).to_have_text("uv / cma")  # rpcnb's default transport
            assert cell.get_attribute("title").startswith("uv: TCP")
            expect(monitor.locator("td[data-pair='worker0->worker1'] .rpcnb-num").last) \
                .not_to_contain_text(" 0 calls")
            expect(monitor.locator("svg.rpcnb-latency polyline")).to_have_count(2)
            expect(monitor.locator("svg.rpcnb-curve polyline")).to_have_count(2)
            expect(monitor.locator(".rpcnb-status")).to_contain_text(": live")
            monitor.scroll_into_view_if_needed()
            monitor.screenshot(path=str(shots / "channel-monitor.png"))

            # the device-map editor: a change in a control changes the validation message
            editor = page.locator(".rpcnb-devmap")
            expect(editor).to_be_visible()
            expect(editor.locator(".rpcnb-valid")).to_be_visible()
            expect(editor.locator("select")).to_have_count(4)  # 2 local GPUs x 2 peers

            def pick(local: str, remote: str) -> None:
                editor.locator(f"select[data-peer='worker1'][data-local='{local}']") \
                    .select_option(remote)

            pick("cuda:0", "cuda:1")
            expect(editor.locator(".rpcnb-form-string")).to_have_text("1_0_1")
            pick("cuda:1", "cuda:1")
            problem = editor.locator(".rpcnb-problem").first
            expect(problem).to_contain_text("duplicated target device")
            expect(editor.locator(".rpcnb-valid")).to_have_count(0)
            editor.scroll_into_view_if_needed()
            editor.screenshot(path=str(shots / "devmap-editor-problem.png"))
            pick("cuda:1", "cuda:0")
            expect(editor.locator(".rpcnb-valid")).to_be_visible()
            expect(editor.locator(".rpcnb-form-string")).to_have_text("1_0_1,1_1_0")
            editor.locator("button.rpcnb-apply").click()
            expect(editor.locator(".rpcnb-applied")).to_contain_text("Applied")
            editor.screenshot(path=str(shots / "devmap-editor.png"))
            page.screenshot(path=str(shots / "lab.png"))

            # %rpc_shutdown: the monitor says it stopped
            run_cell(page, 5)
            expect(monitor.locator(".rpcnb-status")).to_contain_text("stopped", timeout=60_000)
        except BaseException:
            page.screenshot(path=str(shots / "failure.png"))  # what the browser showed
            raise
        finally:
            lab["started"].update(children_of(lab["pid"]))
            browser.close()
    # The docs' screenshots are refreshed on request only, so a test run leaves the tree
    # clean: RPCNB_UPDATE_SCREENSHOTS=1 make test
    if os.environ.get("RPCNB_UPDATE_SCREENSHOTS") == "1":
        DOCS_STATIC.mkdir(parents=True, exist_ok=True)
        for name in ("channel-monitor.png", "devmap-editor-problem.png", "devmap-editor.png"):
            shutil.copy(shots / name, DOCS_STATIC / name)
