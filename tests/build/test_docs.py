"""The documentation site builds with Sphinx, warnings as errors, and has its key pages.

Runs ``scripts/build_docs.py --no-execute`` (what ``make docs`` runs, with the committed
executed tutorials of notebooks/executed/ and no kernel: tests/kernel/test_notebooks.py runs the
notebooks) into a temporary directory, so the repository's docs/_build is left alone.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
FIGURES = {"03_parameter_server": 1, "04_a3c": 1, "05_federated_averaging": 1,
           "06_pipeline": 1, "07_channels_and_device_maps": 1,
           "08_ddp_parameter_server": 1}  # as in test_notebooks.py
BUILD_TIMEOUT = 240  # seconds; about 10 s on the reference machine


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    build = tmp_path_factory.mktemp("docs")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "build_docs.py"), "--no-execute",
         "--build-dir", str(build)],
        capture_output=True, text=True, timeout=BUILD_TIMEOUT, cwd=ROOT,
    )
    assert proc.returncode == 0, (
        f"the docs do not build warning-free (exit {proc.returncode}):\n"
        f"{proc.stdout}\n{proc.stderr}")
    return build / "html"


def _page(site: Path, name: str) -> str:
    page = site / name
    assert page.is_file(), f"{name} was not built"
    return page.read_text(encoding="utf-8")


@pytest.mark.parametrize("name", ["index.html", "getting-started.html", "concepts.html",
                                  "magics.html", "channels.html", "architecture.html",
                                  "benchmarks.html", "security.html", "load.html", "troubleshooting.html",
                                  "tutorials.html", "api.html", "existing-code.html",
                                  "settings.html", "clusters.html", "panel.html", "ucx.html"])
def test_page_exists(site: Path, name: str) -> None:
    _page(site, name)


def test_api_reference_documents_the_public_functions(site: Path) -> None:
    html = _page(site, "api.html")
    for name in ("rpcnb.init", "rpcnb.join", "rpcnb.run", "rpcnb.shutdown",
                 "rpcnb.cells.call.run", "rpcnb.errors.RemoteError",
                 "rpcnb.wire.devicemap.DeviceMap", "rpcnb.observe.channels.predict_group",
                 "rpcnb.observe.probe.probe", "rpcnb.paths.shm.stats", "rpcnb.telemetry.summary",
                 "rpcnb.integrations.ipyparallel.attach", "rpcnb.observe.doctor.check"):
        assert f'id="{name}"' in html, f"{name} is missing from the API reference"
    assert "as a cell and wait for it" in html  # rpcnb.run's docstring


def test_magics_guide_covers_every_magic(site: Path) -> None:
    html = _page(site, "magics.html")
    for magic in ("%rpc_init", "%%remote", "%rpc_workers", "%rpc_shutdown", "%rpc_probe",
                  "%rpc_channels", "%rpc_devmap", "%rpc_jobs", "%rpc_restart", "--bg",
                  "--add", "%rpc_doctor"):
        assert magic in html, f"{magic} is missing from the magics guide"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_every_notebook_is_a_tutorial_page(site: Path, path: Path) -> None:
    html = _page(site, f"tutorials/{path.stem}.html")
    assert "rpc_shutdown" in html  # the code cells are rendered, down to the last one
    assert f"tutorials/{path.stem}.html" in _page(site, "tutorials.html")


@pytest.mark.parametrize("stem", FIGURES, ids=list(FIGURES))
def test_tutorial_pages_show_outputs_and_figures(site: Path, stem: str) -> None:
    # the committed executed copy is published (a stale one fails tests/kernel/test_notebooks.py)
    html = _page(site, f"tutorials/{stem}.html")
    assert "rpcnb: left the group" in html, f"{stem}: the page shows no outputs"
    images = re.findall(r'<img[^>]+src="\.\./_images/[0-9a-f]+\.png"', html)
    assert len(images) == FIGURES[stem], f"{stem}: {len(images)} figures on the page"


def test_screenshots_are_shipped(site: Path) -> None:
    assert list((site / "_images").glob("*.png")), "the channels page lost its screenshots"
    assert "panel.png" in _page(site, "panel.html"), "the panel page lost its screenshots"
