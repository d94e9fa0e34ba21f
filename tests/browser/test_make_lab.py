"""The README's `make lab` opens JupyterLab on the tutorials, with rpcnb's kernel: run as the
README says (plus flags for a test: loopback, a token, no browser of its own), then looked
at in Debian's Chromium. The server and everything it started stop by pid."""

from __future__ import annotations

import os
import re
import secrets
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

from conftest import Seen, children_of

from .server import CHROMIUM, CHROMIUM_ARGS, browser_or_skip, free_port

ROOT = Path(__file__).resolve().parents[2]
TUTORIALS = sorted(p.name for p in (ROOT / "notebooks").glob("*.ipynb"))


def test_readme_starts_with_the_two_commands():
    readme = (ROOT / "README.md").read_text()
    first_block = re.search(r"```\n(.*?)```", readme, re.S)
    assert first_block and first_block.group(1).split("\n")[:2] == ["make demo", "make test"]
    assert "download.pytorch.org/whl/cpu" in readme  # the CPU wheel, on any machine
    assert "make lab" in (ROOT / "docs" / "contributing.md").read_text()


def test_make_lab_opens_jupyterlab_on_the_tutorials(tmp_path):
    browser_or_skip()
    port, token = free_port(), secrets.token_hex(16)
    args = (f"--no-browser --ServerApp.ip=127.0.0.1 --ServerApp.port={port} "
            f"--ServerApp.port_retries=0 --IdentityProvider.token={token} "
            "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"
            + (" --allow-root" if os.geteuid() == 0 else ""))
    env = dict(os.environ, JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"),
               JUPYTERLAB_SETTINGS_DIR=str(tmp_path / "settings"),
               JUPYTERLAB_WORKSPACES_DIR=str(tmp_path / "workspaces"))
    log = open(tmp_path / "lab.log", "wb")
    server = subprocess.Popen(["make", "-s", "lab", f"LAB_ARGS={args}"], cwd=ROOT, env=env,
                              stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    started = Seen([server.pid])
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 300  # make may build .venv first
        while True:
            started.update(children_of(server.pid))
            try:
                with urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=2):
                    break
            except OSError:
                assert server.poll() is None and time.monotonic() < deadline, \
                    (tmp_path / "lab.log").read_text()[-3000:]
                time.sleep(0.3)
        import json

        with urllib.request.urlopen(f"{url}/api/kernelspecs?token={token}") as resp:
            specs = json.load(resp)["kernelspecs"]
        assert {"python3", "rpcnb"} <= set(specs)  # rpcnb's isolated kernel is offered too
        from playwright.sync_api import expect, sync_playwright

        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            try:
                page = browser.new_page(viewport={"width": 1400, "height": 900})
                page.goto(f"{url}/lab?token={token}")
                listing = page.locator(".jp-DirListing-content")
                for name in TUTORIALS:
                    expect(listing.get_by_text(name, exact=True)).to_be_visible(timeout=60_000)
                page.goto(f"{url}/lab/tree/01_quickstart.ipynb?token={token}")
                expect(page.locator(".jp-CodeCell").filter(has_text="%load_ext rpcnb").first
                       ).to_be_visible(timeout=60_000)
                kernel = page.locator(".jp-KernelName, .jp-Toolbar-kernelName").first
                expect(kernel).to_contain_text("Python 3", timeout=60_000)
                page.screenshot(path=str(tmp_path / "make-lab.png"))
            finally:
                browser.close()
    finally:
        started.update(children_of(server.pid))
        try:
            os.killpg(server.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            server.wait(15)
        except subprocess.TimeoutExpired:
            pass
        log.close()
        time.sleep(0.2)
        started.kill()
