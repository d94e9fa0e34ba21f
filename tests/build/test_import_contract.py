"""The layers contract of pyproject.toml (import-linter's ``lint-imports``, what ``make
lint`` runs) holds for rpcnb, and fails on an upward import inside a function. The rest of
the package's shape is checked without a process in tests/unit/test_layers.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "rpcnb"
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"


def lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(root))
    return subprocess.run([str(LINT_IMPORTS), "--no-cache"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=120)


def test_layers_contract_is_kept():
    proc = lint_imports(ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 broken" in proc.stdout


def test_the_contract_catches_an_upward_import_inside_a_function(tangled: Path):
    proc = lint_imports(tangled)
    assert proc.returncode != 0
    assert "rpcnb.session.state -> rpcnb.api" in proc.stdout
