"""The RPC panel when it matters most, in a real JupyterLab driven by Chromium: at
JupyterLab's default sidebar width every column of the members table and the channel
matrix is inside the panel, nothing cut off; while a long remote cell keeps the kernel busy,
a page opened then (a reload: a second look at a training run) shows the live group, not
"Asking the kernel for its group..."; the worker's "interrupt" button ends that cell while it
runs; an action that must wait for the cell ("Add a worker") says so, and runs when the
cell ends; "restart" gives a worker a new process; "Copy join line" puts the join line on
the clipboard.
"""

from __future__ import annotations

import os
import re
import shutil

import pytest
from conftest import children_of

from .server import DOCS_STATIC, run_cell
from .test_lab_panel import not_blank, notebook_page

pytestmark = pytest.mark.xdist_group("browser")  # one JupyterLab for the session (conftest.py)

LONG = 60  # seconds the long cell would run: the test interrupts it long before
CELLS = [
    "%load_ext rpcnb\n%rpc_init --workers 2",
    "%%remote --all --fetch\n1",
    f"%%remote worker1\nimport time\nfor i in range({LONG * 10}):\n    time.sleep(0.1)",
    "%%remote worker1 --fetch\ni",
]
BUSY = "Python 3 (rpcnb) | Busy"
RUNNING = "A cell is running in this notebook."  # the panel's line (model.ts TEXT.busy)

# every cell of the panel's tables whose content is cut: wider than its box, or past the
# panel's right edge (what a person at the default sidebar width would not see)
CUT = """panel => {
  const edge = panel.getBoundingClientRect().right + 1;
  const cut = [];
  for (const cell of panel.querySelectorAll(
      'table.rpcnb-panel-members th, table.rpcnb-panel-members td,' +
      'table.rpcnb-panel-channels th, table.rpcnb-panel-channels td')) {
    const box = cell.getBoundingClientRect();
    if (box.right > edge || cell.scrollWidth > cell.clientWidth + 1) {
      cut.push(cell.textContent.slice(0, 40) + ' (right ' + Math.round(box.right) +
               ' > ' + Math.round(edge) + ', scroll ' + cell.scrollWidth + ' > ' +
               cell.clientWidth + ')');
    }
  }
  // a table's head on one line (the matrix's upright heads too), never broken in two
  for (const head of panel.querySelectorAll(
      'table.rpcnb-panel-members th, table.rpcnb-panel-channels th')) {
    const upright = getComputedStyle(head).writingMode.startsWith('vertical');
    const range = document.createRange();
    range.selectNodeContents(head);
    const lines = new Set([...range.getClientRects()].map(
      r => Math.round(upright ? r.left : r.top)));
    if (lines.size > 1) {
      cut.push(head.textContent + ' (head on ' + lines.size + ' lines)');
    }
  }
  return cut;
}"""


def start_cell(page, index: int) -> None:
    """Start cell ``index`` running and return at once (the kernel stays busy)."""
    cell = page.locator(".jp-Notebook .jp-Cell").nth(index)
    cell.locator(".jp-InputArea-editor").click()
    page.keyboard.press("Shift+Enter")


def open_panel(page):
    from playwright.sync_api import expect

    page.locator(".rpcnb-status-item").click()
    panel = page.locator("#rpcnb-panel")
    expect(panel).to_be_visible()
    return panel


def test_panel_is_readable_live_while_busy_and_acts(lab, new_page, tmp_path):
    from playwright.sync_api import expect

    shots = tmp_path / "screenshots"
    with notebook_page(lab, new_page, "busy.ipynb", CELLS, shots, clipboard=True) as page:
        run_cell(page, 0)
        run_cell(page, 1)
        lab["started"].update(children_of(lab["pid"]))
        panel = open_panel(page)
        rows = panel.locator("table.rpcnb-panel-members tr[data-member]")
        expect(rows).to_have_count(3)
        expect(panel.locator("td[data-pair='worker0->worker1']")).to_be_visible()

        # JupyterLab's default sidebar width: every column inside the panel, none cut
        width = panel.bounding_box()["width"]
        assert width < 400, f"the panel is {width} px wide: not the default sidebar width"
        assert panel.evaluate(CUT) == [], panel.evaluate(CUT)
        for col in ("name", "alive", "calls", "recent"):
            expect(panel.locator(f"tr[data-member='worker1'] td[data-col='{col}']")) \
                .to_be_visible()
        expect(panel.locator("tr[data-member='worker1'] [data-col='pid']")).to_have_text(
            re.compile(r"^\d+$"))
        panel.screenshot(path=str(shots / "panel-default-width.png"))

        # a long remote cell: the kernel is busy; a page opened now shows the live group
        start_cell(page, 2)
        expect(page.get_by_text(BUSY)).to_be_visible()
        page.reload()  # (JupyterLab's status bar may say Idle after a reload: ask the panel)
        page.locator(".jp-Notebook .jp-Cell").first.wait_for()
        panel = open_panel(page)
        rows = panel.locator("table.rpcnb-panel-members tr[data-member]")
        expect(rows).to_have_count(3, timeout=20_000)
        message = panel.locator(".rpcnb-panel-message")
        expect(message).to_contain_text(RUNNING)  # the picture came while the cell runs
        interrupt = panel.locator("tr[data-member='worker1'] button[data-action='interrupt']")
        expect(interrupt).to_be_enabled(timeout=10_000)  # worker1 runs this kernel's cell
        expect(panel.locator("tr[data-member='worker2'] button[data-action='interrupt']")) \
            .to_be_disabled()
        # this kernel: no interrupt or restart (its stacks only)
        assert not panel.locator("tr[data-member='worker0'] button[data-action='interrupt'], "
                                 "tr[data-member='worker0'] button[data-action='restart']") \
            .count()

        # an action that waits for the cell says so; interrupt does not wait behind it
        panel.locator("button[data-action='add']").click()
        note = panel.locator(".rpcnb-panel-note")
        expect(note).to_have_text("add: waits for the running cell to end...")
        interrupt.click()
        expect(message).not_to_contain_text(RUNNING, timeout=15_000)  # the cell ended
        expect(note).to_contain_text("added: worker3", timeout=120_000)  # then add ran
        expect(rows).to_have_count(4)
        lab["started"].update(children_of(lab["pid"]))
        # the cell was cut short, and worker1 kept its namespace
        run_cell(page, 3)
        got = page.locator(".jp-Notebook .jp-Cell").nth(3).locator(".jp-OutputArea-output")
        expect(got).to_have_text(re.compile(r"^\d+$"))
        assert int(got.inner_text()) < LONG * 10 - 1

        # restart: worker2 is a new process
        pid_cell = panel.locator("tr[data-member='worker2'] [data-col='pid']")
        old_pid = int(pid_cell.inner_text())
        panel.locator("tr[data-member='worker2'] button[data-action='restart']").click()
        expect(note).to_contain_text("restarted worker2", timeout=120_000)
        expect(pid_cell).not_to_have_text(str(old_pid), timeout=10_000)
        lab["started"].update(children_of(lab["pid"]))
        expect(panel.locator("tr[data-member='worker2'] td[data-col='alive']")) \
            .to_have_text("alive")

        # copy the join line: on the clipboard, as the note shows it
        panel.locator("button[data-action='join']").click()
        expect(note).to_contain_text("copied: %rpc_init --join")
        line = note.inner_text().removeprefix("copied: ").strip()
        assert page.evaluate("navigator.clipboard.readText()") == line
        assert panel.evaluate(CUT) == [], panel.evaluate(CUT)  # four members, still readable
        panel.screenshot(path=str(shots / "panel-actions.png"))
    for name in ("panel-default-width.png", "panel-actions.png"):
        not_blank(shots / name)
    assert "Unknown subshell" not in lab["log"]()
    if os.environ.get("RPCNB_UPDATE_SCREENSHOTS") == "1":  # docs/panel.md's picture
        shutil.copy(shots / "panel-actions.png", DOCS_STATIC / "panel-actions.png")
