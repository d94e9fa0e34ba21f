"""The layers contract of pyproject.toml (import-linter's ``lint-imports``, what ``make
lint`` runs) holds for rpcnb, and fails on an upward import inside a function. The rest of
the package's shape is checked without a process in tests/unit/test_layers.py."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "rpcnb"
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"


def lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(root))
    return subprocess.run([str(LINT_IMPORTS), "--no-cache"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.fixture
def tangled(tmp_path: Path) -> Path:
    """A copy of the package where a low layer imports the API inside a function."""
    shutil.copytree(PACKAGE, tmp_path / "rpcnb", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    with open(tmp_path / "rpcnb" / "session" / "state.py", "a") as f:
        f.write("\n\ndef _upward():\n    from rpcnb import api\n\n    return api\n")
    return tmp_path


def test_layers_contract_is_kept():
    proc = lint_imports(ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 broken" in proc.stdout


def test_the_contract_catches_an_upward_import_inside_a_function(tangled: Path):
    proc = lint_imports(tangled)
    assert proc.returncode != 0
    assert "rpcnb.session.state -> rpcnb.api" in proc.stdout
