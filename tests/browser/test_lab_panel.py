"""rpcnb's JupyterLab extension in a real JupyterLab, driven by Debian's Chromium: the
"RPC" side panel and the status bar item follow a notebook on the rpcnb kernel. The
panel lists the group's three members with their pids; a %%remote cell's RRef shows in
the panel and its "free" button frees it on the worker; a worker killed by pid shows dead
in the panel and the status item within 5 s; after %rpc_shutdown the panel says there is
no group; its form starts a group and its button shuts it down; after a kernel restart it
says rpcnb is not loaded, and connects again after %load_ext rpcnb. Screenshots go to the
test's tmp_path (and to docs/_static/ with RPCNB_UPDATE_SCREENSHOTS=1), checked not to be
blank either way. In a group started with --ucx --no-shm (rpcnb's shared memory would carry a
CPU tensor on one host), a tensor pushed to worker1 travels over
UCX, and the panel's channel matrix and the channel monitor both name UCX's transport
("ucx: cma" on one host) for worker0 -> worker1, as the kernel reports it.

The extension is the one `make` built and installed (labextension/, shared data of the
editable install); the test fails if JupyterLab does not list it.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import children_of

from .server import DOCS_STATIC, open_notebook, run_cell, write_notebook

pytestmark = pytest.mark.xdist_group("browser")  # one JupyterLab for the session (conftest.py)

CELLS = [
    "%load_ext rpcnb\n%rpc_init --workers 2",
    "%%remote worker1 -o t\nimport torch\ntorch.ones(256, 1024)",
    "print('t is held:', 't' in globals())",
    "%rpc_shutdown",
    "%load_ext rpcnb",
]


UCX_CELLS = [
    "%load_ext rpcnb\n%rpc_init --workers 1 --ucx --no-shm",
    "import torch\nt = torch.ones(1024, 1024)  # 4 MB: above the UCX path's 1 MB threshold",
    "%%remote worker1 --push t --fetch\nt.sum().item()",
    "from rpcnb.paths import ucx\nprint('UCX transport:', ucx.transports()['worker1'])",
    "%rpc_channels",
    "%rpc_shutdown",
]
NO_UCX = "the ucx extra is not installed: pip install -e '.[test,ucx]' (ucxx-cu12)"


@contextlib.contextmanager
def notebook_page(lab, new_page, notebook: str, cells, shots: Path, clipboard: bool = False):
    """A page of this test's own with ``notebook`` (written from ``cells``) open in the lab
    (with ``clipboard``, allowed to read and write the clipboard); a screenshot of the page
    to ``shots`` if the test fails in it; the kernel's processes recorded for the lab
    fixture to stop, either way."""
    write_notebook(lab["root"] / notebook, cells, kernel="rpcnb")
    shots.mkdir(exist_ok=True)
    page = new_page(1500, 1000, clipboard=clipboard)
    try:
        open_notebook(page, lab, notebook, kernel="rpcnb")
        yield page
    except BaseException:
        page.screenshot(path=str(shots / "failure.png"))
        raise
    finally:
        lab["started"].update(children_of(lab["pid"]))


def not_blank(png: Path) -> None:
    """A screenshot that shows something: more than a handful of distinct colours."""
    from PIL import Image

    with Image.open(png) as im:
        colours = im.convert("RGB").getcolors(maxcolors=1 << 16)
    assert colours is None or len(colours) > 8, f"{png} is blank"


def widen(page, panel) -> None:
    """Drag the handle left of the right side bar so the panel is 700 px wide."""
    box = panel.bounding_box()
    handle = page.locator("#jp-main-split-panel > .lm-SplitPanel-handle:not(.lm-mod-hidden)").last
    hb = handle.bounding_box()
    page.mouse.move(hb["x"] + hb["width"] / 2, hb["y"] + hb["height"] / 2)
    page.mouse.down()
    page.mouse.move(box["x"] + box["width"] - 700, hb["y"] + hb["height"] / 2, steps=5)
    page.mouse.up()


def test_extension_is_installed_and_enabled():
    out = subprocess.run([sys.executable, "-m", "jupyter", "labextension", "list"],
                         capture_output=True, text=True, timeout=120)
    text = re.sub(r"\x1b\[[0-9;]*m", "", out.stdout + out.stderr)
    assert re.search(r"rpcnb v[\d.]+ enabled OK", text), text


def test_panel_follows_the_group(lab, new_page, tmp_path):
    from playwright.sync_api import expect

    shots = tmp_path / "screenshots"
    with notebook_page(lab, new_page, "panel.ipynb", CELLS, shots) as page:
        status = page.locator(".rpcnb-status-item")
        expect(status).to_be_visible()  # before rpcnb is loaded: "RPC"
        status.click()  # the status item opens the panel
        panel = page.locator("#rpcnb-panel")
        expect(panel).to_be_visible()
        widen(page, panel)
        expect(panel.locator(".rpcnb-panel-message")).to_contain_text("%load_ext rpcnb")

        run_cell(page, 0)
        lab["started"].update(children_of(lab["pid"]))
        rows = panel.locator("table.rpcnb-panel-members tr[data-member]")
        expect(rows).to_have_count(3)
        expect(status).to_have_text("RPC 3/3")
        expect(status).to_have_attribute("data-health", "ok")
        pids = {}
        for name in ("worker0", "worker1", "worker2"):
            row = panel.locator(f"tr[data-member='{name}']")
            expect(row.locator("td[data-col='alive']")).to_have_text("alive")
            pids[name] = int(row.locator("[data-col='pid']").inner_text())
        lab["started"].update(pids.values())
        worker1_cmd = Path(f"/proc/{pids['worker1']}/cmdline").read_bytes()
        assert b"rpcnb" in worker1_cmd, worker1_cmd  # the pid is the worker's

        # an RRef held by this kernel, and "free" dropping it
        run_cell(page, 1)
        rref = panel.locator("table.rpcnb-panel-rrefs tr", has_text="worker1")
        expect(rref).to_have_count(1)
        expect(rref.locator(".rpcnb-rref-names")).to_have_text("t")
        expect(rref).to_contain_text("Tensor")
        expect(rref).to_contain_text("1.0 MB")
        expect(panel.locator("td[data-pair='worker0->worker1']")).to_be_visible()
        expect(panel.locator("tr[data-member='worker1'] svg.rpcnb-panel-spark polyline")) \
            .to_have_count(1)  # worker1's latency over the last minutes
        panel.screenshot(path=str(shots / "panel.png"))
        page.once("dialog", lambda dialog: dialog.accept("fetched"))
        rref.locator("button[data-action='fetch']").click()
        expect(panel.locator(".rpcnb-panel-note")).to_contain_text(
            "fetched = Tensor from worker1")
        rref.locator("button[data-action='free']").click()
        expect(panel.locator(".rpcnb-panel-note")).to_contain_text("freed: t dropped")
        expect(panel.locator("table.rpcnb-panel-rrefs tr")).to_have_count(0)
        run_cell(page, 2)
        expect(page.locator(".jp-Notebook .jp-Cell").nth(2)).to_contain_text("t is held: False")

        # "Channel monitor": a cell with %rpc_channels at the end, run, its widget shown
        panel.locator("button", has_text="Channel monitor").click()
        expect(page.locator(".jp-Notebook .jp-Cell").last).to_contain_text("%rpc_channels")
        expect(page.locator(".rpcnb-monitor")).to_be_visible()

        # a worker killed by pid: dead in the panel and the status item within 5 s
        os.kill(pids["worker2"], signal.SIGKILL)
        killed = time.monotonic()
        expect(panel.locator("tr[data-member='worker2'] td[data-col='alive']")) \
            .to_contain_text("dead", timeout=5_000)
        expect(status).to_have_text("RPC 2/3", timeout=5_000)
        expect(status).to_have_attribute("data-health", "dead", timeout=5_000)
        seen_dead = time.monotonic() - killed
        assert seen_dead < 5, seen_dead
        panel.screenshot(path=str(shots / "panel-dead.png"))
        page.locator(".jp-StatusBar-Widget").first.screenshot(path=str(shots / "status.png"))

        run_cell(page, 3)  # %rpc_shutdown
        expect(panel.locator(".rpcnb-panel-message")).to_contain_text("No group in this kernel")
        expect(status).to_have_text("RPC: no group")
        expect(panel.locator("form.rpcnb-panel-start")).to_be_visible()

        # the panel's own actions: start a group of 2, then shut it down
        panel.locator("form.rpcnb-panel-start input[name='workers']").fill("1")
        panel.locator("form.rpcnb-panel-start button[type='submit']").click()
        expect(rows).to_have_count(2)
        expect(panel.locator(".rpcnb-panel-note")).to_contain_text("started: worker0, worker1")
        expect(status).to_have_text("RPC 2/2")
        lab["started"].update(children_of(lab["pid"]))
        panel.locator("button[data-action='shutdown']").click()
        expect(panel.locator(".rpcnb-panel-message")).to_contain_text("No group in this kernel")

        # a kernel restart: the new kernel has no rpcnb until %load_ext, then the
        # panel connects again by itself
        page.locator(".jp-Notebook").click()
        page.keyboard.press("Escape")
        page.keyboard.press("0")
        page.keyboard.press("0")
        page.locator(".jp-Dialog button.jp-mod-accept").click()
        expect(panel.locator(".rpcnb-panel-message")).to_contain_text("%load_ext rpcnb")
        expect(status).to_have_text("RPC")
        expect(page.get_by_text("Python 3 (rpcnb) | Idle")).to_be_visible()
        run_cell(page, 4)
        expect(panel.locator(".rpcnb-panel-message")).to_contain_text("No group in this kernel")
    for name in ("panel.png", "panel-dead.png"):
        not_blank(shots / name)
    # the kernel dropped no message of the panel's (see docs/panel.md on subshells)
    assert "Unknown subshell" not in lab["log"]()
    if os.environ.get("RPCNB_UPDATE_SCREENSHOTS") == "1":
        DOCS_STATIC.mkdir(parents=True, exist_ok=True)
        for name in ("panel.png", "panel-dead.png"):
            shutil.copy(shots / name, DOCS_STATIC / name)


@pytest.mark.skipif(importlib.util.find_spec("ucxx") is None, reason=NO_UCX)
def test_panel_and_monitor_show_the_ucx_path(lab, new_page, tmp_path):
    """One JupyterLab for both front ends (starting another costs more than the test)."""
    from playwright.sync_api import expect

    shots = tmp_path / "screenshots"
    with notebook_page(lab, new_page, "ucx.ipynb", UCX_CELLS, shots) as page:
        page.locator(".rpcnb-status-item").click()
        panel = page.locator("#rpcnb-panel")
        expect(panel).to_be_visible()
        widen(page, panel)
        cells = page.locator(".jp-Notebook .jp-Cell")

        run_cell(page, 0)
        lab["started"].update(children_of(lab["pid"]))
        expect(panel.locator("table.rpcnb-panel-members tr[data-member]")).to_have_count(2)
        pair = panel.locator("td[data-pair='worker0->worker1']")
        expect(pair.locator(".rpcnb-panel-path")).to_have_count(1)  # nothing over UCX yet
        expect(pair.locator(".rpcnb-panel-paths")).to_have_count(0)

        for i in (1, 2, 3):
            run_cell(page, i)
        expect(cells.nth(2).locator(".jp-OutputArea-output")).to_contain_text("1048576")
        said = cells.nth(3).locator(".jp-OutputArea-output").inner_text()
        found = re.search(r"UCX transport: (\w+)", said)
        assert found, said  # the kernel knows which UCX transport carried the tensor
        ucx_path = f"ucx: {found.group(1)}"

        # the panel: TensorPipe's path, UCX's transport under it, the tensor it carried
        expect(pair.locator(".rpcnb-panel-ucx")).to_have_text(ucx_path)
        expect(pair.locator(".rpcnb-panel-paths")).to_have_text(f"{ucx_path} ×1")
        expect(pair.locator(".rpcnb-panel-path").first).to_have_text(re.compile(r"^\S+ / \S+$"))
        assert f"{ucx_path}: 1 tensor, 4.0 MB" in pair.get_attribute("title")
        expect(panel.locator("td[data-pair='worker1->worker0'] .rpcnb-panel-ucx")) \
            .to_have_count(0)  # nothing came back over UCX
        panel.locator(".rpcnb-panel-body").screenshot(path=str(shots / "panel-ucx.png"))

        # the channel monitor says the same for the pair
        run_cell(page, 4)
        monitor = page.locator(".rpcnb-monitor")
        expect(monitor).to_be_visible()
        cell = monitor.locator("td[data-pair='worker0->worker1']")
        expect(cell.locator(".rpcnb-ucx")).to_have_text(ucx_path)
        expect(cell.locator(".rpcnb-paths")).to_have_text(f"{ucx_path} ×1")

        run_cell(page, 5)
        expect(panel.locator(".rpcnb-panel-message")).to_contain_text("No group in this kernel")
    not_blank(shots / "panel-ucx.png")
    if os.environ.get("RPCNB_UPDATE_SCREENSHOTS") == "1":
        DOCS_STATIC.mkdir(parents=True, exist_ok=True)
        shutil.copy(shots / "panel-ucx.png", DOCS_STATIC / "panel-ucx.png")
