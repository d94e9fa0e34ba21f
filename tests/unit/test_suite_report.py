"""What ``make test`` says at its end about the shared kernels (scripts/test_suite.py):
the starts of every test process summed, and why each early stop happened."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("test_suite_script", ROOT / "scripts" / "test_suite.py")
assert spec and spec.loader
suite = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = suite  # its dataclasses look their module up
spec.loader.exec_module(suite)


def test_the_shared_kernels_line_sums_every_test_process_and_says_why(tmp_path, monkeypatch):
    monkeypatch.setattr(suite, "RESULTS", tmp_path)
    assert suite.kernel_report() == ""  # pytest run alone: nothing recorded, nothing said
    (tmp_path / "shared-kernel-gw0-11.txt").write_text("starts 1\n")
    (tmp_path / "shared-kernel-gw1-12.txt").write_text(
        "starts 3\ntests/kernel/test_a.py::test_x: the test failed\n"
        "tests/kernel/test_b.py::test_y: a member of its group died in the test\n")
    lines = suite.kernel_report().splitlines()
    assert lines[0] == "shared kernels: 4 started in 2 test processes, 2 of them stopped before the end:"
    assert lines[1:] == ["  tests/kernel/test_a.py::test_x: the test failed",
                         "  tests/kernel/test_b.py::test_y: a member of its group died in the test"]
