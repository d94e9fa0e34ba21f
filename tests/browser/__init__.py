"""The browser tests. A package so that their conftest.py (the session's JupyterLab) is the
module ``browser.conftest`` and never takes the place of tests/conftest.py, which every
test folder imports as ``conftest``."""
