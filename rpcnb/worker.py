"""A worker process: ``main()`` makes a fresh Python a member of a group.

``rpcnb.procs.launch`` has the kernel's warm launcher (``rpcnb.procs.forkserver``) fork it and call
``main(argv, secret)``. It builds a namespace (``__name__ ==
"__main__"``) with a headless IPython shell, so ``display()``, magics and
``get_ipython()`` work in remote cells; joins the group; registers with the leader; and
runs remote cells on its main thread until it is asked to leave. A thread watches the
kernel that started it, and ends the process when it is gone (the launcher may go first:
the workers it forked stay the group's).

``python -m rpcnb.worker --join ADDR`` is the same worker started by hand, or by a
cluster's launcher (``srun``, ``mpiexec``) on a machine without Jupyter: it joins a
running group like a kernel does, names itself from the launcher's rank when no
``--name`` is given, reads the group's token from a file of mode 0600 or from its stdin
(never from its command line, which ``ps`` shows every user), and leaves when the group
ends or its first kernel is gone; while the network to that kernel is down it waits (15
minutes at most), so a partition that heals leaves it in the group with its namespace.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import threading
import time
from typing import Any

from rpcnb import errors, machine
from rpcnb.cells import comms, console, output
from rpcnb.cells.runner import CellRunner
from rpcnb.errors import RpcnbError
from rpcnb.membership import failures, handlers, leave, start
from rpcnb.paths import shm, ucx
from rpcnb.procs import launch, processes
from rpcnb.session import protocol
from rpcnb.wire import options

# The launchers' own rank variables, in the order a worker names itself from them.
RANK_VARIABLES = ("SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK")
LEADER_SILENT_S = 15.0  # a headless worker leaves once its leader has not answered this long
LEADER_UNREACHABLE_S = 900.0  # ... or this long, when the leader's host answers nothing at all


def _watch_parent(parent_pid: int, init_method: str) -> None:
    """A worker process never outlives the kernel that started it (``parent_pid``). The
    launcher that forked it for that kernel may go (replaced, or killed) without taking
    the group's workers with it."""
    while True:
        time.sleep(0.5)
        if processes.pid_alive(parent_pid):
            continue
        # The kernel died: take its shared memory and its group's directory (the
        # connection file holds the secret) with ours, nobody else will.
        shm.deactivate()
        shm.remove_segments_of(parent_pid)
        if init_method.startswith("file://"):
            shutil.rmtree(os.path.dirname(init_method[len("file://"):]), ignore_errors=True)
        os._exit(3)


def main(argv: list[str] | None = None, secret: str | None = None) -> None:
    """A worker of the group ``argv`` names; ``secret`` is the group's (read from stdin
    when it is not given)."""
    import argparse

    argv = sys.argv[1:] if argv is None else argv
    if not any(a == "--init-method" or a.startswith("--init-method=") for a in argv):
        # a person's command (python -m rpcnb.worker --join ..., or --help): the
        # launcher's own flags are not theirs to see
        headless(argv)
        return
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
    comms.install_worker()  # widgets made here are relayed to the notebook
    if secret is None:
        secret = sys.stdin.readline().strip()  # a leader wrote it into our stdin pipe
    s = start.start_member(args.name, args.rank, args.init_method,
                           options.GroupOptions.from_json(args.options),
                           leader=args.leader, runner=runner, secret=secret)
    output.set_background(output.Capture(None, args.leader, args.name, s.token))
    console.install_worker()  # after the secret was read from stdin
    if start.register(s, timeout=30) is None:
        print(f"rpcnb: {args.leader} did not admit {args.name}; leaving.", file=sys.stderr)
        os._exit(4)
    runner.run_forever()  # until the leader asks this worker to leave
    sys.stdout.flush()
    os._exit(0)


def headless_parser() -> Any:
    import argparse

    ap = argparse.ArgumentParser(
        prog="python -m rpcnb.worker",
        description="Join a running rpcnb group as a worker (no Jupyter needed).")
    ap.add_argument("--join", required=True, metavar="ADDR",
                    help="tcp://HOST:PORT of the group (or its connection file on this host)")
    ap.add_argument("--token-file", default=None, metavar="PATH",
                    help="a file of mode 0600 with the group's token (or its connection.json)")
    ap.add_argument("--token", default=None, metavar="-",
                    help="'-': read the token from stdin (never the token itself: ps shows it)")
    ap.add_argument("--name", default=None,
                    help="this worker's name; {rank} is the launcher's rank (default: "
                         "worker<rank+1> from SLURM_PROCID or OMPI_COMM_WORLD_RANK)")
    ap.add_argument("--interface", default=None,
                    help="the network interface TensorPipe listens on (default: the one "
                         "that reaches the group's host)")
    ap.add_argument("--threads", type=int, default=options.DEFAULT_THREADS)
    ap.add_argument("--timeout", type=float, default=options.DEFAULT_RPC_TIMEOUT)
    ap.add_argument("--no-shm", action="store_true",
                    help="move tensors over TensorPipe only, not rpcnb's shared memory")
    ap.add_argument("--ucx", action="store_true", default=None,
                    help="move large tensors over UCX, as the group does (also RPCNB_UCX=1)")
    ap.add_argument("--no-zero-copy", action="store_true",
                    help="copy tensors that are already in shared memory too, instead of "
                         "sending them by handle (sharing their pages)")
    return ap


def launcher_rank(env: dict[str, str] | None = None) -> int | None:
    """The rank srun, mpiexec or another PMI launcher gave this process, or None."""
    env = dict(os.environ) if env is None else env
    for var in RANK_VARIABLES:
        value = env.get(var, "").strip()
        if value.isdigit():
            return int(value)
    return None


def worker_name(given: str | None, env: dict[str, str] | None = None) -> str:
    """The name a headless worker takes: ``given`` with ``{rank}`` filled in, or
    ``worker<rank+1>`` from the launcher's rank (ValueError when there is none)."""
    rank = launcher_rank(env)
    if given is not None and "{rank}" not in given:
        name = given
    elif rank is None:
        raise ValueError(errors.HEADLESS_NO_NAME.format(variables=", ".join(RANK_VARIABLES)))
    else:
        name = given.replace("{rank}", str(rank)) if given else f"worker{rank + 1}"
    options.check_name(name)
    return name


def read_token(token: str | None, token_file: str | None, join: str) -> str | None:
    """The group's token for a headless worker: from ``token_file`` (mode 0600, the token
    or a connection.json), from stdin (``token == "-"``), or None when ``join`` is a
    connection file that holds it. A token on the command line is refused."""
    if token is not None and token != "-":
        raise ValueError(errors.TOKEN_ON_COMMAND_LINE)
    if token == "-":
        got = sys.stdin.readline().strip()
        if not got:
            raise ValueError(errors.TOKEN_STDIN_EMPTY)
        return got
    if token_file is None:
        if join.startswith("tcp://"):
            raise ValueError(errors.TOKEN_NEEDED.format(addr=join))
        return None
    import json
    import stat

    try:
        fd = os.open(token_file, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError as exc:
        raise ValueError(errors.TOKEN_FILE_UNREADABLE.format(path=token_file,
                                                             reason=exc.strerror)) from None
    with os.fdopen(fd) as f:
        info = os.fstat(f.fileno())
        if info.st_uid != os.getuid() or stat.S_IMODE(info.st_mode) & 0o077:
            raise ValueError(errors.TOKEN_FILE_OPEN.format(
                path=token_file, mode=oct(stat.S_IMODE(info.st_mode))))
        text = f.read().strip()
    if text.startswith("{"):
        try:
            text = str(json.loads(text)["secret"])
        except (ValueError, KeyError, TypeError):
            raise ValueError(errors.TOKEN_FILE_UNREADABLE.format(
                path=token_file, reason="a JSON file without a 'secret'")) from None
    if not text:
        raise ValueError(errors.TOKEN_FILE_UNREADABLE.format(path=token_file, reason="it is empty"))
    return text.splitlines()[0].strip()


def headless(argv: list[str]) -> None:
    """``python -m rpcnb.worker --join ...``: join a running group, run its cells on the
    main thread until the group ends (exit 0), or say why not (exit 2)."""
    args = headless_parser().parse_args(argv)
    launch.apply_quiet_env()
    try:
        secret = read_token(args.token, args.token_file, args.join)
        name = worker_name(args.name)
        opts = options.validate(args.threads, args.timeout, shm=not args.no_shm,
                                zero_copy=not args.no_zero_copy, ucx=ucx.option(args.ucx))
    except (ValueError, errors.RpcnbError) as exc:
        print(f"rpcnb.worker: {exc}", file=sys.stderr)
        sys.exit(2)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    handlers.install()
    ns: dict[str, Any] = {"__name__": "__main__", "__builtins__": __builtins__}
    shell = _make_shell(ns)
    runner = CellRunner(name, ns, shell)
    runner.on_main = True
    runner.kind_name = "headless"
    output.install_routing(shell)
    comms.install_worker()  # widgets made here are relayed to the notebook
    try:
        s = start.join_member(args.join, name, opts, runner, token=secret,
                              interface=args.interface)
    except (ValueError, RpcnbError) as exc:
        print(f"rpcnb.worker: {exc}", file=sys.stderr)
        sys.stderr.flush()
        os._exit(2)
    output.set_background(output.Capture(None, s.leader, name, s.token))
    console.install_worker()
    print(f"rpcnb.worker: {name} (rank {s.rank}, pid {os.getpid()}) joined the group of "
          f"{s.leader}", file=sys.__stderr__, flush=True)
    threading.Thread(target=_watch_leader, args=(s, runner), name="rpcnb-watch",
                     daemon=True).start()
    runner.run_forever()  # until the leader asks this worker to leave
    sys.stdout.flush()
    os._exit(0)


def _watch_leader(s: Any, runner: CellRunner) -> None:
    """A headless worker leaves when its group's first kernel is gone (it may be on
    another host: no pid to watch), so a batch job never outlives the notebook: after
    ``LEADER_SILENT_S`` without an answer while the leader's host still answers (the
    connection closed, or TCP acknowledges what is sent), after ``LEADER_UNREACHABLE_S``
    when its host answers nothing at all (a partition: the worker waits for the network
    to come back, with its namespace)."""
    url = s.init_method
    address = url[len("tcp://"):].rpartition(":")[0].strip("[]") if url.startswith("tcp://") else ""
    silent_since: float | None = None
    cut_off = False  # the leader's host itself answers nothing
    # a heartbeat, not a wait for one thing (rpcnb.waiting): each ping's answer decides anew
    # (the leader answers, is silent, or its host is cut off) and counts since when
    while not s.closing:
        time.sleep(1.0)
        try:
            protocol.call(s.token, s.leader, "probe_echo", timeout=5)
            if cut_off:
                print(f"rpcnb.worker: {s.leader} answers again.", file=sys.__stderr__, flush=True)
            silent_since, cut_off = None, False
            continue
        except Exception as exc:
            if s.closing:
                return
            now = time.monotonic()
            silent_since = silent_since or now
            heard = machine.heard_from(address) if address else None
            was = cut_off
            cut_off = not failures.process_gone(exc) and (heard is None or heard > 5)
            if cut_off and not was:
                print(errors.HEADLESS_LEADER_UNREACHABLE.format(
                    leader=s.leader, seconds=LEADER_UNREACHABLE_S), file=sys.__stderr__,
                    flush=True)
            limit = LEADER_UNREACHABLE_S if cut_off else LEADER_SILENT_S
            if now - silent_since > limit:
                print(errors.HEADLESS_LEADER_GONE.format(leader=s.leader, seconds=limit),
                      file=sys.__stderr__, flush=True)
                leave.leave_group(timeout=5, graceful=False)
                runner.stop()
                return


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


if __name__ == "__main__":
    # run the module's own copy (rpcnb.worker), not this __main__ one: a remote cell's
    # namespace becomes __main__ here
    from rpcnb.worker import main as _main

    _main()
