"""Where a worker is now, in the RPC panel of a real JupyterLab driven by Chromium: while
a background cell sleeps on worker1, worker1's row says which cell it runs and the line it
is at; its "stacks" button shows worker1's threads under the tables, the cell's thread
first with the line it sleeps on; once the cell is cancelled, the busy line goes.
"""

from __future__ import annotations

import re

import pytest
from conftest import children_of

from .server import run_cell
from .test_lab_panel import not_blank, notebook_page
from .test_lab_panel_busy import open_panel

pytestmark = pytest.mark.xdist_group("browser")  # one JupyterLab for the session (conftest.py)

CELLS = [
    "%load_ext rpcnb\n%rpc_init --workers 2",
    "%%remote worker1 --bg -o nap_job\nimport time\ndef nap():\n    time.sleep(120)\nnap()",
    "nap_job.cancel()\nnap_job.wait(30)",
]


def test_a_busy_worker_shows_its_line_and_its_stacks(lab, new_page, tmp_path):
    from playwright.sync_api import expect

    shots = tmp_path / "screenshots"
    with notebook_page(lab, new_page, "stacks.ipynb", CELLS, shots) as page:
        run_cell(page, 0)
        lab["started"].update(children_of(lab["pid"]))
        run_cell(page, 1)  # a background cell: the notebook's cell returns at once
        panel = open_panel(page)
        row = panel.locator("tr[data-member='worker1']")
        busy = row.locator(".rpcnb-member-busy")
        expect(busy).to_have_text(re.compile(
            r"^runs <worker1 cell \d+> \(import time\) since \d\d:\d\d:\d\d, "
            r"at line 3: time\.sleep\(120\)"), timeout=20_000)
        assert not panel.locator("tr[data-member='worker2'] .rpcnb-member-busy").count()

        row.locator("button[data-action='stacks']").click()
        note = panel.locator(".rpcnb-panel-note")
        expect(note).to_contain_text("worker1's threads now:", timeout=15_000)
        text = note.locator("pre.rpcnb-panel-text")
        expect(text).to_contain_text(re.compile(
            r"^worker1, thread MainThread: running <worker1 cell \d+> since "))
        expect(text).to_contain_text("in nap\n    time.sleep(120)")
        expect(text).to_contain_text("idle threads (rpcnb, torch, the kernel)")
        panel.screenshot(path=str(shots / "panel-stacks.png"))

        # this kernel has stacks too (its cell runner waits for a cell)
        panel.locator("tr[data-member='worker0'] button[data-action='stacks']").click()
        expect(text).to_contain_text("worker0: runs no cell now.", timeout=15_000)

        run_cell(page, 2)  # cancelled: worker1 is idle again
        expect(busy).to_have_count(0, timeout=20_000)
    not_blank(shots / "panel-stacks.png")
