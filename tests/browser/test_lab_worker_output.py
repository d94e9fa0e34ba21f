"""Worker output in a real JupyterLab and Chromium: a tqdm bar on two workers is two lines
that move while the cell runs, each marked with its worker; a slider made on a worker,
moved in the page, changes the value on the worker."""

from __future__ import annotations

import os
import re
import shutil
import time

import pytest
from conftest import children_of

from .server import DOCS_STATIC, open_notebook, run_cell, write_notebook
from .test_lab_panel import not_blank, widen

pytestmark = pytest.mark.xdist_group("browser")  # one JupyterLab for the session (conftest.py)


def torch_has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()

CELLS = [
    "%load_ext rpcnb\n%rpc_init --workers 2",
    "%%remote --all\nfrom tqdm import tqdm\nimport time\n"
    "for i in tqdm(range(50), mininterval=0.05):\n    time.sleep(0.1)",
    "%%remote worker1\nimport ipywidgets as w\n"
    "s = w.IntSlider(value=3, min=0, max=100, description='lr')\ndisplay(s)",
    "%%remote worker1 --fetch\ns.value",
    "%rpc_shutdown",
]


def percents(page, cell) -> dict[str, int]:
    """What each worker's bar in ``cell`` shows now: {worker: percent}."""
    found = {}
    for text in cell.locator(".jp-OutputArea-output").all_inner_texts():
        m = re.match(r"\[(worker\d)\]\s+(\d+)%", text.strip())
        if m:
            found[m.group(1)] = int(m.group(2))
    return found


def test_bars_and_a_slider_from_workers(lab, new_page, tmp_path):
    from playwright.sync_api import expect

    write_notebook(lab["root"] / "output.ipynb", CELLS)
    page = new_page(1400, 1100)
    try:
        open_notebook(page, lab, "output.ipynb")
        run_cell(page, 0)
        lab["started"].update(children_of(lab["pid"]))

        # the bars: started, not waited for
        cell = page.locator(".jp-Notebook .jp-Cell").nth(1)
        cell.locator(".jp-InputArea-editor").click()
        page.keyboard.press("Shift+Enter")
        seen: list[dict[str, int]] = []
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            now = percents(page, cell)
            if len(now) == 2 and (not seen or now != seen[-1]):
                seen.append(now)
            if now and min(now.values()) == 100:
                break
            time.sleep(0.25)
        page.screenshot(path=str(tmp_path / "bars.png"))
        moving = [s for s in seen if max(s.values()) < 100]
        assert len(moving) >= 3, seen  # two lines, seen moving while the cell ran
        for w in ("worker1", "worker2"):
            assert len({s[w] for s in moving}) >= 3, seen
        expect(cell.locator(".jp-InputPrompt")).to_have_text(re.compile(r"\[\d+\]"))
        assert percents(page, cell) == {"worker1": 100, "worker2": 100}
        bars = cell.locator(".jp-OutputArea-output").filter(has_text=re.compile(r"^\[worker"))
        expect(bars).to_have_count(2)  # one region per worker, not a line per update

        # the slider: a real widget in the page; moved there, it moves on the worker
        run_cell(page, 2)
        slider = page.locator(".jp-Notebook .jp-Cell").nth(2).locator(".widget-slider")
        expect(slider).to_be_visible()
        expect(slider.locator(".widget-readout")).to_have_text("3")
        handle = slider.locator(".noUi-handle")
        handle.click()
        for _ in range(5):
            handle.press("ArrowRight")
        expect(slider.locator(".widget-readout")).to_have_text("8")
        time.sleep(0.5)  # the page's messages reach the idle kernel, then the worker
        run_cell(page, 3)
        out = page.locator(".jp-Notebook .jp-Cell").nth(3).locator(".jp-OutputArea-output")
        expect(out.last).to_have_text("8")
        page.screenshot(path=str(tmp_path / "slider.png"))

        # the README's picture: this notebook with the RPC panel open beside it
        page.locator(".jp-SideBar.jp-mod-left .lm-TabBar-tab.lm-mod-current").click()
        page.locator(".rpcnb-status-item").click()
        panel = page.locator("#rpcnb-panel")
        expect(panel.locator("table.rpcnb-panel-members tr[data-member]")).to_have_count(3)
        if not torch_has_cuda():  # each member's GPU memory, or that it has no GPU
            expect(panel.locator("tr[data-member='worker1'] [data-col='devices']")) \
                .to_have_text("cpu (no GPU)")
        widen(page, panel)
        shot = tmp_path / "notebook-with-panel.png"
        page.screenshot(path=str(shot))
        not_blank(shot)
        if os.environ.get("RPCNB_UPDATE_SCREENSHOTS") == "1":
            shutil.copy(shot, DOCS_STATIC / "notebook-with-panel.png")
        run_cell(page, 4)
    finally:
        lab["started"].update(children_of(lab["pid"]))
