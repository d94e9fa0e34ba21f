"""%rpc_doctor's widget in a real JupyterLab, looked at in Debian's Chromium: a notebook
starts a group with one spawned worker, a headless worker joins it from a private mount
namespace with a 32 MB /dev/shm that looks like a container (conftest's
``small_shm_worker``), and ``%rpc_doctor`` shows one box per member with that member's
findings, the small /dev/shm as a problem with what to do. Then the connection file is
opened to other users and "Check again" shows the leader's new problem and its advice;
after ``%rpc_shutdown`` the button says why it cannot check. Screenshots go to tmp_path
(and to docs/_static/ with RPCNB_UPDATE_SCREENSHOTS=1). Every process stops by pid."""

from __future__ import annotations

import os
import shutil

import pytest
from conftest import children_of, private_shm_blocker, small_shm_worker

from .server import DOCS_STATIC, open_notebook, run_cell, write_notebook

pytestmark = pytest.mark.xdist_group("browser")  # one JupyterLab for the session (conftest.py)

CELLS = [
    "%load_ext rpcnb\n%rpc_init --workers 1\nimport rpcnb.session.state, pathlib\n"
    "_ = pathlib.Path('connection.txt').write_text(str(rpcnb.session.state.current().connection_path))",
    # wait here until the headless worker the test starts has joined
    "import time\nfor _ in range(600):\n"
    "    if 'tiny' in [m.name for m in rpcnb.group().members if m.alive]:\n        break\n"
    "    time.sleep(0.2)\nprint('members:', [m.name for m in rpcnb.group().members])",
    "%rpc_doctor",
    "%rpc_shutdown",
]


def test_doctor_widget_in_jupyterlab(lab, new_page, tmp_path):
    why = private_shm_blocker()
    if why:
        pytest.skip(why)
    from playwright.sync_api import expect

    write_notebook(lab["root"] / "doctor.ipynb", CELLS, kernel="python3")
    shots = tmp_path / "screenshots"
    shots.mkdir()
    tiny = None
    page = new_page(1300, 1100)
    try:
        open_notebook(page, lab, "doctor.ipynb")
        run_cell(page, 0)
        conn = (lab["root"] / "connection.txt").read_text()
        tiny = small_shm_worker(conn, "tiny", tmp_path / "tiny.log")
        run_cell(page, 1)
        cells = page.locator(".jp-Notebook .jp-Cell")
        expect(cells.nth(1).locator(".jp-OutputArea-output")).to_contain_text("'tiny'")
        run_cell(page, 2)
        lab["started"].update(children_of(lab["pid"]))

        report = page.locator(".rpcnb-doctor")
        expect(report).to_be_visible()
        boxes = report.locator(".rpcnb-member")
        expect(boxes).to_have_count(4)  # worker0 (this kernel), worker1, tiny, every member
        assert [boxes.nth(i).get_attribute("data-member") for i in range(4)] == \
            ["worker0", "worker1", "tiny", "all"]
        expect(boxes.nth(0).locator(".rpcnb-member-head")).to_contain_text("worker0 (this kernel)")
        for name in ("worker0", "worker1", "tiny"):  # each member's own findings
            box = report.locator(f".rpcnb-member[data-member='{name}']")
            for check in ("/dev/shm", "cma", "interface"):
                expect(box.locator(f"tr[data-check='{check}']")).to_have_count(1)
        expect(report.locator(".rpcnb-summary")).to_have_text("1 problem found")

        # the problem made on purpose, with what to do, on the member that has it
        tiny_box = report.locator(".rpcnb-member[data-member='tiny']")
        expect(tiny_box).to_have_class("rpcnb-member rpcnb-worst-warn")
        expect(tiny_box.locator(".rpcnb-member-head")).to_contain_text("1 problem")
        shm = tiny_box.locator("tr[data-check='/dev/shm']")
        expect(shm).to_have_attribute("data-level", "warn")
        expect(shm.locator(".rpcnb-badge")).to_have_text("problem")
        expect(shm.locator(".rpcnb-detail")).to_contain_text("32 MB")
        expect(shm.locator(".rpcnb-todo")).to_contain_text(
            "what to do: containers default to 64 MB: run with --shm-size=8g")
        assert tiny_box.locator("tr.rpcnb-finding").first.get_attribute("data-check") == \
            "/dev/shm"  # problems first
        container = tiny_box.locator("tr[data-check='container']")
        expect(container).to_have_attribute("data-level", "note")
        expect(container.locator(".rpcnb-detail")).to_contain_text("container=podman")
        # the machine's own /dev/shm is fine, and the marker is only tiny's
        worker1 = report.locator(".rpcnb-member[data-member='worker1']")
        expect(worker1.locator("tr[data-check='/dev/shm']")).to_have_attribute("data-level", "ok")
        expect(worker1).not_to_contain_text("container=podman")
        expect(report.locator(".rpcnb-member[data-member='all'] tr[data-check='versions']")) \
            .to_have_attribute("data-level", "ok")
        report.scroll_into_view_if_needed()
        report.screenshot(path=str(shots / "doctor-report.png"))

        # a connection file others can read: "Check again" shows it, with the fix
        token = report.locator(".rpcnb-member[data-member='worker0'] tr[data-check='token']")
        expect(token).to_have_attribute("data-level", "ok")
        os.chmod(conn, 0o644)
        try:
            report.locator("button.rpcnb-check-again").click()
            expect(token).to_have_attribute("data-level", "warn")
            expect(token.locator(".rpcnb-todo")).to_contain_text(f"chmod 600 {conn}")
            expect(report.locator(".rpcnb-summary")).to_have_text("2 problems found")
            report.screenshot(path=str(shots / "doctor-report-token.png"))
        finally:
            os.chmod(conn, 0o600)

        # after %rpc_shutdown the report stays, and checking again says why it cannot
        run_cell(page, 3)
        tiny.wait(60)
        report.locator("button.rpcnb-check-again").click()
        expect(report.locator(".rpcnb-failed")).to_contain_text(
            "the check failed: This process is not in an RPC group yet")
        expect(report.locator(".rpcnb-member")).to_have_count(4)
    except BaseException:
        page.screenshot(path=str(shots / "failure.png"))  # what the browser showed
        raise
    finally:
        lab["started"].update(children_of(lab["pid"]))
        if tiny is not None and tiny.poll() is None:
            tiny.kill()
            tiny.wait(5)
    assert tiny.returncode == 0, (tmp_path / "tiny.log").read_text()[-2000:]
    if os.environ.get("RPCNB_UPDATE_SCREENSHOTS") == "1":
        DOCS_STATIC.mkdir(parents=True, exist_ok=True)
        shutil.copy(shots / "doctor-report.png", DOCS_STATIC / "doctor-report.png")
