"""The JupyterLab extension's TypeScript unit tests (labextension/src/__tests__, jest),
run from the suite so that `make test` runs them: `make` installed labextension's
node_modules from its yarn.lock when it built the extension."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

LABEXT = Path(__file__).resolve().parents[2] / "labextension"
NOT_INSTALLED = ("labextension/node_modules is missing: run `make labextension` (make test "
                 "and make .venv do it) to install the extension's packages from yarn.lock.")


def test_typescript_unit_tests_pass():
    assert (LABEXT / "node_modules" / ".bin" / "jest").exists(), NOT_INSTALLED
    env = dict(os.environ, CI="true",
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    out = subprocess.run(["jlpm", "test"], cwd=LABEXT, capture_output=True, text=True,
                         timeout=240, env=env)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-4000:]
    found = re.search(r"Tests:\s+(\d+) passed, (\d+) total", text)
    assert found and found.group(1) == found.group(2) and int(found.group(1)) >= 8, text[-2000:]
