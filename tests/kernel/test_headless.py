"""A notebook run headless (nbclient, as papermill runs it) is quiet when nothing is wrong:
no "No handler found for comm target" for rpcnb's panel, which only JupyterLab shows."""

from __future__ import annotations

import logging

import nbformat
from conftest import Seen, children_of
from nbclient import NotebookClient


def test_a_headless_run_prints_no_comm_warning(tmp_path):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(src) for src in (
        "%load_ext rpcnb", "%rpc_init --workers 1", "%%remote worker1 --fetch\n6 * 7",
        "%load_ext rpcnb", "%rpc_shutdown")]
    client = NotebookClient(nb, timeout=120, kernel_name="python3", resources={
        "metadata": {"path": str(tmp_path)}})
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    client.log.addHandler(Keep(level=logging.DEBUG))
    started = Seen()
    try:
        with client.setup_kernel():
            pid = client.km.provisioner.pid  # type: ignore[union-attr]
            started.add(pid)
            for i, cell in enumerate(nb.cells):
                client.execute_cell(cell, i)
                started.update(children_of(pid))
    finally:
        started.kill()
    said = [r.getMessage() for r in records if r.levelno >= logging.WARNING]
    assert not [m for m in said if "comm target" in m], said
    assert nb.cells[2].outputs[0]["data"]["text/plain"] == "42"
    for cell in nb.cells:
        assert not [o for o in cell.outputs if o.get("name") == "stderr"], cell.outputs
