"""The widgets in a real JupyterLab, driven by a real browser: JupyterLab served on
loopback with a token, Debian's Chromium driven by Playwright (the session's, conftest.py),
a notebook that starts a live group, probes it, shows the channel monitor and the device-map
editor. Changing a mapping in the editor changes the validation message. Screenshots go to
the test's tmp_path (and to docs/_static/ with RPCNB_UPDATE_SCREENSHOTS=1).

Without Chromium the test skips and says why; under CI (CI=true) it fails instead.
"""

from __future__ import annotations

import os
import shutil

import pytest
from conftest import children_of

from .server import DOCS_STATIC, open_notebook, run_cell, write_notebook

pytestmark = pytest.mark.xdist_group("browser")  # one JupyterLab for the session (conftest.py)

CELLS = [
    "%load_ext rpcnb\n%rpc_init --workers 2",
    "%rpc_probe --sizes 1K,16K,256K,1M,8M --repeats 1",
    "import rpcnb\nfor _ in range(10):\n    rpcnb.run('worker1', '1 + 1')\n    rpcnb.run('worker2', '2 + 2')",
    "%rpc_channels",
    "%rpc_devmap --topology worker0=2,worker1=2,worker2=1",
    "%rpc_shutdown",
]


def test_monitor_and_editor_in_jupyterlab(lab, new_page, tmp_path):
    from playwright.sync_api import expect

    write_notebook(lab["root"] / "channels.ipynb", CELLS)
    shots = tmp_path / "screenshots"
    shots.mkdir()
    page = new_page(1400, 1100)
    try:
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
    # The docs' screenshots are refreshed on request only, so a test run leaves the tree
    # clean: RPCNB_UPDATE_SCREENSHOTS=1 make test
    if os.environ.get("RPCNB_UPDATE_SCREENSHOTS") == "1":
        DOCS_STATIC.mkdir(parents=True, exist_ok=True)
        for name in ("channel-monitor.png", "devmap-editor-problem.png", "devmap-editor.png"):
            shutil.copy(shots / name, DOCS_STATIC / name)
