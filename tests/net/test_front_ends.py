"""The isolated kernelspec started as VS Code starts it: its argv run directly, with a TCP
connection file and no kernel provisioner. The kernel cannot be isolated then (the front
end could not reach it), so it must run reachable and say it is not isolated: on its
stderr at once, and in the notebook when a group starts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from conftest import Seen, children_of, kill_all, pid_alive
from jupyter_client import BlockingKernelClient
from jupyter_client.connect import write_connection_file

KERNELSPEC = Path(__file__).resolve().parents[2] / "kernelspec" / "kernel.json"


def start(tmp_path: Path, tries: int = 3) -> tuple[subprocess.Popen, BlockingKernelClient, Any]:
    """The kernelspec's argv run as VS Code runs it, with a TCP connection file: its
    process, a client that got its kernel_info reply, and its stderr (a file). The
    connection file's ports are picked free, then the kernel binds them: a test running
    in parallel may take one in between (the kernel exits, "Address already in use"),
    and then it starts again on new ports."""
    argv0 = json.loads(KERNELSPEC.read_text())["argv"]
    for attempt in range(tries):
        conn, _ = write_connection_file(str(tmp_path / f"kernel-{attempt}.json"), transport="tcp",
                                        ip="127.0.0.1")
        argv = [sys.executable if a == "python" else a.replace("{connection_file}", conn)
                for a in argv0]
        err = open(tmp_path / f"stderr-{attempt}", "w+")
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=err)
        kc = BlockingKernelClient(connection_file=conn)
        kc.load_connection_file()
        kc.start_channels()
        try:
            kc.wait_for_ready(timeout=60)  # reachable: it was not moved out of reach
            return proc, kc, err
        except RuntimeError:
            kc.stop_channels()
            kill_all(sorted(p for p in {proc.pid, *children_of(proc.pid)} if pid_alive(p)))
            proc.wait(10)
            err.seek(0)
            said = err.read()
            if "Address already in use" not in said or attempt == tries - 1:
                raise AssertionError(f"the kernel did not start:\n{said[-3000:]}") from None
    raise AssertionError("unreachable")


def test_the_isolated_kernel_says_so_when_a_front_end_skips_its_provisioner(tmp_path):
    proc, kc, err = start(tmp_path)
    started = Seen([proc.pid])
    shown: list[dict] = []
    try:
        reply = kc.execute_interactive("%load_ext rpcnb\n%rpc_init --workers 1\n%rpc_shutdown",
                                       timeout=120, output_hook=lambda m: shown.append(m))
        assert reply["content"]["status"] == "ok"
        text = "".join(m["content"].get("text", "") for m in shown if m["msg_type"] == "stream")
        assert "ports are open to every user of this machine" in text, text
        assert "without rpcnb's kernel provisioner" in text and "VS Code" in text
        started.update(children_of(proc.pid))
    finally:
        kc.stop_channels()
        started.update(children_of(proc.pid))
        started.kill()
        proc.wait(10)
    err.seek(0)
    said = err.read()
    assert "the 'Python 3 (rpcnb)' kernel is NOT isolated" in said, said
