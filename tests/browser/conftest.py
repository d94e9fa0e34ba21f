"""One JupyterLab server for the whole test session of the browser tests
(``server.LabServer``): each test module that uses it puts its tests in the ``browser``
xdist_group, so that under pytest-xdist they take turns on one worker and share it. Each
test still starts clean: its own folder and workspace in the server, its own Chromium and
page, and at its end the sessions and kernels it opened are shut down through the server's
REST API and every process they started is stopped by pid; its teardown fails if one is
left. The server is stopped by pid at the end of the session, also on failure."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from pids import Seen

from rpcnb.procs.processes import descendants

from .server import CHROMIUM, CHROMIUM_ARGS, LabServer, browser_or_skip, gone


@pytest.fixture(scope="session")
def lab_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LabServer]:
    browser_or_skip()
    server = LabServer(tmp_path_factory.mktemp("lab"))
    try:
        yield server
    finally:
        left = server.stop()
    assert not left, f"processes of JupyterLab left running: {left}"


@pytest.fixture
def lab(lab_server: LabServer, request: pytest.FixtureRequest) -> Iterator[dict[str, Any]]:
    """The session's JupyterLab, started clean for this test (``LabServer.begin`` lists
    what it holds); at the end, its sessions and kernels shut down and their processes
    stopped by pid."""
    test = lab_server.begin(request.node.name)
    try:
        yield test
    finally:
        left, listed = lab_server.end(test)
    assert not listed, f"JupyterLab still lists: {listed}"
    assert not left, f"processes left running: {left}"


@pytest.fixture
def new_page(lab: dict[str, Any]) -> Iterator[Callable[..., Any]]:
    """``new_page(width, height, clipboard=False)``: a page in a browser context of its own
    (with ``clipboard``, allowed to read and write the clipboard) of this test's own Debian
    Chromium, headless, driven by Playwright (0.5 s to start here; one kept for the
    session would leave Playwright's asyncio loop marked running in this process between
    its calls, for the tests that come after on this xdist worker). The browser and
    Playwright's driver stop by pid at the end, before the ``lab`` fixture shuts the
    kernels down."""
    from playwright.sync_api import sync_playwright

    me = os.getpid()
    before = set(descendants(me))
    pw = sync_playwright().start()
    mine = Seen()
    try:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        mine = Seen(set(descendants(me)) - before - {lab["pid"], *descendants(lab["pid"])})

        def make(width: int, height: int, clipboard: bool = False) -> Any:
            context = browser.new_context(viewport={"width": width, "height": height})
            if clipboard:
                context.grant_permissions(["clipboard-read", "clipboard-write"],
                                          origin=lab["url"])
            return context.new_page()

        yield make
    finally:
        for pid in list(mine):
            mine.update(descendants(pid))  # renderers started since
        try:
            pw.stop()  # closes the browser
        finally:
            mine.kill()
    left = gone(mine)
    assert not left, f"browser processes left running: {left}"
