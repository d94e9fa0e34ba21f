"""The notebook as the workers' console in a real JupyterLab and Chromium: a breakpoint in a
remote cell shows a pdb prompt in the page, named after the worker; ``p x`` typed there
shows the worker's value; ``c`` lets the cell finish."""

from __future__ import annotations

import re

import pytest
from conftest import children_of

from .server import run_cell
from .test_lab_panel import notebook_page

pytestmark = pytest.mark.xdist_group("browser")  # one JupyterLab for the session (conftest.py)

CELLS = [
    "%load_ext rpcnb\n%rpc_init --workers 1",
    "%%remote worker1 --fetch\nx = 41\nbreakpoint()\nx + 1",
    "%rpc_shutdown",
]


def answer(page, cell, prompt: str, text: str) -> None:
    """Wait for the input box under ``prompt`` in ``cell``, type ``text`` and Enter."""
    from playwright.sync_api import expect

    box = cell.locator(".jp-Stdin").last
    expect(box.locator(".jp-Stdin-prompt")).to_have_text(re.compile(re.escape(prompt)))
    field = box.locator("input.jp-Stdin-input")
    field.fill(text)
    field.press("Enter")


def test_a_remote_breakpoint_is_a_pdb_prompt_in_the_page(lab, new_page, tmp_path):
    from playwright.sync_api import expect

    with notebook_page(lab, new_page, "console.ipynb", CELLS, tmp_path / "shots") as page:
        run_cell(page, 0)
        lab["started"].update(children_of(lab["pid"]))
        cell = page.locator(".jp-Notebook .jp-Cell").nth(1)
        cell.locator(".jp-InputArea-editor").click()
        page.keyboard.press("Shift+Enter")
        answer(page, cell, "[worker1] (Pdb)", "p x")
        expect(cell.locator(".jp-OutputArea-output").filter(
            has_text=re.compile(r"^41$", re.M))).to_have_count(1)
        answer(page, cell, "[worker1] (Pdb)", "c")
        expect(cell.locator(".jp-InputPrompt")).to_have_text(re.compile(r"\[\d+\]"))
        expect(cell.locator(".jp-OutputArea-output").last).to_have_text("42")
        run_cell(page, 2)
