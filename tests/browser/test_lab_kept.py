"""A kept group (%rpc_init --keep) in a real JupyterLab, driven by Debian's Chromium as a
user would: a notebook on the rpcnb kernel starts a kept group of one worker and sets a
value there; the kernel is restarted from the menu (Kernel > Restart Kernel..., the dialog
confirmed); the keeper and the worker live on, and the panel of the new kernel lists the
kept group with no kernel attached and an "attach" button; %rpc_init --attach makes the
new kernel its driver, the value comes back, and the panel shows the group as this
kernel's; %rpc_shutdown ends it and nothing of it is left.

The kernels' runtime folder (``RPCNB_RUNTIME_DIR``, where the kept groups' records are) is
the lab server's own (server.py); the keeper is in a session of its own, so besides
%rpc_shutdown the test stops every process its records name, by pid, whatever happens.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest
from conftest import Seen, children_of, wait_until

from rpcnb.procs.processes import pid_alive

from .server import DOCS_STATIC, gone, run_cell
from .test_lab_panel import not_blank, notebook_page, widen

pytestmark = pytest.mark.xdist_group("browser")  # one JupyterLab for the session (conftest.py)

CELLS = [
    "%load_ext rpcnb\n%rpc_init --workers 1 --keep 10m",
    "%%remote worker1\nw = 42",
    "%load_ext rpcnb",
    "%rpc_init --attach",
    "%%remote worker1 --fetch\nw",
    "%rpc_shutdown",
]


def records(runtime: Path) -> list[dict]:
    """The records of the kept groups in the runtime folder ``runtime``."""
    found = []
    for path in sorted((runtime / "kept").glob("*/record.json")):
        try:
            found.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    return found


def kept_pids(runtime: Path) -> set[int]:
    """Every process of the kept groups recorded in ``runtime``: the keepers, what they
    started (the workers' launcher) and the workers."""
    pids = Seen()
    for rec in records(runtime):
        pids.update(p for p in [rec["pid"], *rec["workers"].values()] if p)
        if rec["pid"]:
            pids.update(children_of(rec["pid"]))
    return pids


def test_a_kept_group_outlives_a_restart_from_the_menu(lab, new_page, tmp_path):
    from playwright.sync_api import expect

    shots = tmp_path / "screenshots"
    runtime: Path = lab["rpcnb_runtime"]
    assert not records(runtime), f"kept groups before the test: {records(runtime)}"
    seen = Seen()
    try:
        with notebook_page(lab, new_page, "kept.ipynb", CELLS, shots) as page:
            page.locator(".rpcnb-status-item").click()
            panel = page.locator("#rpcnb-panel")
            expect(panel).to_be_visible()
            widen(page, panel)
            cells = page.locator(".jp-Notebook .jp-Cell")
            group = panel.locator("table.rpcnb-panel-kept tr[data-group='group1']")

            run_cell(page, 0)
            seen |= kept_pids(runtime)
            lab["started"].update(children_of(lab["pid"]))
            expect(cells.nth(0)).to_contain_text("attached to kept group group1")
            expect(group).to_have_attribute("data-attached", "this kernel")
            run_cell(page, 1)
            [rec] = records(runtime)
            pids = [rec["pid"], *rec["workers"].values()]

            # Kernel > Restart Kernel..., and "Restart" in the dialog
            page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(r"^Kernel$")).click()
            page.locator("li.lm-Menu-item[data-command='kernelmenu:restart']").click()
            page.locator(".jp-Dialog button.jp-mod-accept").click()
            expect(panel.locator(".rpcnb-panel-message")).to_contain_text("%load_ext rpcnb")
            expect(page.get_by_text("Python 3 (rpcnb) | Idle")).to_be_visible()
            seen |= kept_pids(runtime)
            assert all(pid_alive(p) for p in pids), "the kept group did not outlive the kernel"

            # the new kernel, in no group: the panel lists the kept group, none attached
            run_cell(page, 2)
            expect(panel.locator(".rpcnb-panel-message")).to_contain_text(
                "No group in this kernel")
            expect(group).to_have_attribute("data-attached", "no")
            expect(group).to_contain_text("workers: worker1")
            expect(group).to_contain_text("no kernel attached since")
            expect(group).to_contain_text(f"keeper pid {rec['pid']}")
            expect(group).to_contain_text("GPU: no GPU")
            expect(group.locator("button[data-action='attach']")).to_be_enabled()
            expect(group.locator("button[data-action='end']")).to_be_enabled()
            panel.locator(".rpcnb-panel-body").screenshot(path=str(shots / "panel-kept.png"))

            run_cell(page, 3)  # %rpc_init --attach
            expect(cells.nth(3)).to_contain_text("attached to kept group group1")
            run_cell(page, 4)
            expect(cells.nth(4).locator(".jp-OutputArea-output")).to_contain_text("42")
            # the panel: the group (keeper, worker1, this kernel) is this kernel's again
            expect(panel.locator("table.rpcnb-panel-members tr[data-member]")).to_have_count(3)
            expect(group).to_have_attribute("data-attached", "this kernel")
            expect(group.locator("button[data-action='attach']")).to_have_count(0)
            lab["started"].update(children_of(lab["pid"]))

            run_cell(page, 5)  # %rpc_shutdown: the kept group ends
            expect(panel.locator("table.rpcnb-panel-kept")).to_have_count(0)
            assert wait_until(lambda: not any(pid_alive(p) for p in pids), 15), \
                [p for p in pids if pid_alive(p)]
            assert records(runtime) == []
    finally:
        seen |= kept_pids(runtime)
        seen.kill()
    left = gone(seen)
    assert not left, f"processes of the kept group left running: {left}"
    not_blank(shots / "panel-kept.png")
    if os.environ.get("RPCNB_UPDATE_SCREENSHOTS") == "1":
        DOCS_STATIC.mkdir(parents=True, exist_ok=True)
        shutil.copy(shots / "panel-kept.png", DOCS_STATIC / "panel-kept.png")
