"""Completion from a worker in a real JupyterLab driven by Chromium: Tab in a
``%%remote worker1`` cell offers the names that exist only on worker1, not the kernel's of
the same prefix; and worker1's "variables" button in the RPC panel lists its tensor with
shape, dtype, device and size."""

from __future__ import annotations

import re

import pytest
from conftest import children_of

from .server import run_cell
from .test_lab_panel import notebook_page
from .test_lab_panel_busy import open_panel

pytestmark = pytest.mark.xdist_group("browser")  # one JupyterLab for the session (conftest.py)

CELLS = [
    "%load_ext rpcnb\n%rpc_init --workers 2\nonly_here_in_the_kernel = 0",
    "%%remote worker1\nimport torch\nonly_here_on_worker_a = torch.zeros(3, 4)\n"
    "only_here_on_worker_b = 2",
    "%%remote worker1\nprint(only_here_",
]


def test_tab_in_a_remote_cell_offers_the_workers_names(lab, new_page, tmp_path):
    from playwright.sync_api import expect

    shots = tmp_path / "screenshots"
    with notebook_page(lab, new_page, "completion.ipynb", CELLS, shots) as page:
        run_cell(page, 0)
        lab["started"].update(children_of(lab["pid"]))
        run_cell(page, 1)
        editor = page.locator(".jp-Notebook .jp-Cell").nth(2).locator(".jp-InputArea-editor")
        editor.click()
        page.keyboard.press("Control+End")  # after "only_here_"
        page.keyboard.press("Tab")
        completer = page.locator(".jp-Completer")
        expect(completer).to_be_visible(timeout=20_000)
        items = completer.locator(".jp-Completer-item .jp-Completer-match")
        expect(items).to_have_text(["only_here_on_worker_a", "only_here_on_worker_b"])
        page.screenshot(path=str(shots / "completion.png"))
        page.keyboard.press("Enter")  # the first one goes in place, in the cell's text
        expect(editor).to_contain_text("print(only_here_on_worker_a")

        panel = open_panel(page)
        panel.locator("tr[data-member='worker1'] button[data-action='who']").click()
        note = panel.locator(".rpcnb-panel-note")
        expect(note).to_contain_text("worker1: 2 variables", timeout=15_000)
        table = note.locator("pre.rpcnb-panel-text")
        expect(table).to_contain_text(re.compile(
            r"only_here_on_worker_a +torch\.Tensor +\(3, 4\) +float32 +cpu +48 B"))
        expect(table).to_contain_text(re.compile(r"only_here_on_worker_b +int"))
