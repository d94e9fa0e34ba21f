"""``python -m rpcnb.docs PAGE``, the offline command messages name: it prints the page,
lists the pages, and refuses one that does not exist (a Python process of its own)."""

from __future__ import annotations

import subprocess
import sys

from rpcnb import docs


def test_the_docs_command_prints_pages_and_refuses_unknown_ones():
    run = [sys.executable, "-m", "rpcnb.docs"]
    page = subprocess.run([*run, "security"], capture_output=True, text=True, timeout=60)
    assert page.returncode == 0 and page.stdout.startswith("# Security"), page
    assert "RuntimeWarning" not in page.stderr, page.stderr
    listing = subprocess.run(run, capture_output=True, text=True, timeout=60)
    assert "security" in listing.stdout and docs.SITE in listing.stdout
    bad = subprocess.run([*run, "no-such-page"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "there is no page 'no-such-page'" in bad.stderr
    # every page a message names exists
    for page in ("security", "clusters", "getting-started"):
        assert docs.text(page)
