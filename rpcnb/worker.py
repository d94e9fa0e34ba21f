"""A worker process: ``main()`` makes a fresh Python a member of a group.

``rpcnb.launch`` starts it as ``python -c "from rpcnb.worker import main; main()" ...``
and writes the group's secret into its stdin. It builds a namespace (``__name__ ==
"__main__"``) with a headless IPython shell, so ``display()``, magics and
``get_ipython()`` work in remote cells; joins the group; registers with the leader; and
runs remote cells on its main thread until it is asked to leave. A thread watches the
kernel that started it and ends the process when that kernel is gone.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import threading
import time
from typing import Any

from rpcnb import handlers, shm, start
from rpcnb.cells import output
from rpcnb.cells.runner import CellRunner


def _watch_parent(parent_pid: int, init_method: str) -> None:
    """A worker process never outlives the kernel that started it."""
    while True:
        time.sleep(0.5)
        if os.getppid() != parent_pid:
            # The kernel died: take its shared memory and its group's directory (the
            # connection file holds the secret) with ours, nobody else will.
            shm.deactivate()
            shm.remove_segments_of(parent_pid)
            if init_method.startswith("file://"):
                shutil.rmtree(os.path.dirname(init_method[len("file://"):]), ignore_errors=True)
            os._exit(3)


def main(argv: list[str] | None = None) -> None:
    import argparse
    import json

    ap = argparse.ArgumentParser(prog="rpcnb.worker")
    ap.add_argument("--init-method", required=True)
    ap.add_argument("--name", required=True)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--leader", required=True)
    ap.add_argument("--parent-pid", type=int, required=True)
    ap.add_argument("--options", default="{}", help="JSON of TensorPipe options")
    args = ap.parse_args(argv)

    threading.Thread(target=_watch_parent, args=(args.parent_pid, args.init_method),
                     daemon=True).start()
    signal.signal(signal.SIGINT, signal.default_int_handler)
    handlers.install()

    ns: dict[str, Any] = {"__name__": "__main__", "__builtins__": __builtins__}
    shell = _make_shell(ns)
    runner = CellRunner(args.name, ns, shell)
    runner.on_main = True  # it will own the main thread (and says "process" from now on)
    output.install_routing(shell)
    secret = sys.stdin.readline().strip()  # the leader writes it into our stdin pipe
    s = start.start_member(args.name, args.rank, args.init_method, json.loads(args.options),
                           leader=args.leader, runner=runner, secret=secret)
    output.set_background(output.Capture(None, args.leader, args.name, s.token))
    if start.register(s, timeout=30) is None:
        print(f"rpcnb: {args.leader} did not admit {args.name}; leaving.", file=sys.stderr)
        os._exit(4)
    runner.run_forever()  # until the leader asks this worker to leave
    sys.stdout.flush()
    os._exit(0)


def _make_shell(ns: dict[str, Any]) -> Any:
    """A headless IPython shell, so remote cells get display(), magics and get_ipython()."""
    from IPython.core.interactiveshell import InteractiveShell
    from traitlets.config import Config

    class WorkerShell(InteractiveShell):
        def enable_gui(self, gui: str | None = None) -> None:
            # %matplotlib inline needs no event loop; a worker has no screen for others.
            if gui not in (None, "inline"):
                raise RuntimeError(f"A worker has no screen for the {gui!r} GUI: use "
                                   "%matplotlib inline, figures show in the calling cell.")

    cfg = Config()
    cfg.HistoryManager.enabled = False
    return WorkerShell.instance(config=cfg, user_ns=ns)
