"""The IPython magics: parse the line, call the API, display. No RPC logic here."""

from __future__ import annotations

import re
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, line_magic, magics_class, no_var_expand
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

from rpcnb import errors
from rpcnb.procs import launch
from rpcnb.sandbox import isolation
from rpcnb.session import state
from rpcnb.wire import options

NO_TARGET = "Name the worker(s) to run on, e.g. %%remote worker1 or %%remote worker1,worker2, or use --all."
NO_EXPR = "Give the expression to run: %remote worker1 EXPR (or use %%remote for a whole cell)."
PUSH_MISSING = "--push: there is no variable {name!r} in this notebook to send."
JOIN_NEEDS_NAME = "--join needs --name: the name this kernel takes in the group, e.g. --name alice."
JOIN_NO_WORKERS = "--join and --workers do not go together: the group's first kernel starts the workers."
JOIN_NO_LISTEN = "--port/--host/--allow-remote are for the group's first kernel, not with --join."
JOIN_NO_GPUS = (
    "--gpus picks GPUs for the workers the group's first kernel starts; a joining kernel "
    "uses what it sees (set CUDA_VISIBLE_DEVICES before starting it)."
)
ADD_ALONE = "--add N goes alone (or with --gpus for the added workers): %rpc_init --add 2."
BG_STARTED = (
    "rpcnb: background cell [{id}] on {workers} started; its output comes here. "
    "{name}.result() when it ends, {name}.cancel() to stop it, %rpc_jobs lists them."
)
BAD_OUTPUT_NAME = "-o {name!r} is not a valid Python variable name."

# Options of the remote magics that take a value (for splitting the line form).
_VALUED = {"-o", "--push", "--timeout"}


def _csv(text: str | None) -> list[str] | None:
    if text is None:
        return None
    return [p.strip() for p in text.split(",") if p.strip()]


def _remote_args(func: Any) -> Any:
    """Flags shared by %remote and %%remote, written once."""
    for deco in reversed([
        magic_arguments(),
        argument("target", nargs="?", default=None,
                 help="worker name, or several separated by commas"),
        argument("--all", action="store_true", help="every worker but this kernel"),
        argument("-o", dest="output", default=None, help="bind the result to this name"),
        argument("--fetch", action="store_true", help="return the value, not an RRef"),
        argument("--push", default=None, help="send these notebook variables first: a,b"),
        argument("--timeout", type=float, default=None,
                 help="interrupt the cell after this many seconds"),
        argument("--bg", action="store_true",
                 help="return at once with a handle; the output keeps coming into this cell"),
        argument("--copy", action="store_true",
                 help="copy tensors already in shared memory (--push, --fetch) instead of "
                      "sharing their pages with the receiver"),
    ]):
        func = deco(func)
    return func


def _device_map_spec(text: str, user_ns: dict[str, Any]) -> Any:
    """--device-map takes a dict literal, DI-engine's string, or a notebook variable."""
    try:
        return options.device_map_spec(text, user_ns)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _split_line_form(line: str) -> tuple[str, str]:
    """Split '%remote [flags] WORKER EXPR' into the flag part and the expression, raw."""
    pos = 0
    expect_value = False
    while True:
        m = re.match(r"\s*(\S+)", line[pos:])
        if not m:
            return line, ""
        tok = m.group(1)
        pos += m.end()
        if expect_value:
            expect_value = False
            continue
        if tok.startswith("-"):
            expect_value = tok in _VALUED
            continue
        # tok is the target, unless --all was given (then it is the expression's start)
        head = line[:pos]
        if "--all" in head.split()[:-1]:
            return line[: pos - len(tok)], line[pos - len(tok):].strip()
        return head, line[pos:].strip()


def _parse(func: Any, line: str) -> Any:
    try:
        return parse_argstring(func, line)
    except ValueError as exc:  # e.g. an unbalanced quote
        raise UsageError(f"Cannot read the magic's arguments ({exc}): check the quotes.")


def parse_init_line(line: str) -> Any:
    """%rpc_init's flags; a UsageError for anything malformed."""
    return _parse(RpcMagics.rpc_init, line)


def parse_remote_line(line: str, cell: str | None) -> tuple[Any, str]:
    """%remote / %%remote's flags and code; a UsageError for anything malformed."""
    if cell is None:
        flags, code = _split_line_form(line)
        args = _parse(RpcMagics.remote, flags)
        if not code.strip():
            raise UsageError(NO_EXPR)
    else:
        args = _parse(RpcMagics.remote, line)
        code = cell
    if args.all and args.target:
        raise UsageError(f"Give either --all or worker names ({args.target!r}), not both.")
    if not args.all and not args.target:
        raise UsageError(NO_TARGET)
    if args.output is not None and not args.output.isidentifier():
        raise UsageError(BAD_OUTPUT_NAME.format(name=args.output))
    if args.timeout is not None and not args.timeout > 0:
        raise UsageError(f"--timeout must be a positive number of seconds, not {args.timeout}.")
    return args, code


@magics_class
class RpcMagics(Magics):
    """%rpc_init, %%remote, %remote, %rpc_workers, %rpc_shutdown."""

    @magic_arguments()
    @argument("--workers", type=int, default=0, help="start this many worker processes")
    @argument("--name", default=None, help="this kernel's name in the group")
    @argument("--join", default=None, metavar="ADDR", help="join the group at ADDR")
    @argument("--timeout", type=float, default=None, help="RPC timeout in seconds (default 60)")
    @argument("--threads", type=int, default=None, help="RPC threads per process (default 16)")
    @argument("--channels", default=None, help="TensorPipe channels to allow, e.g. basic,cma")
    @argument("--transports", default=None, help="TensorPipe transports to allow, e.g. uv,shm")
    @argument("--device-map", default=None, metavar="SPEC",
              help="this kernel's device map: {'worker1': {0: 1}}, DI-engine's 1_0_1,2_0_2, "
                   "or auto (every GPU to the same index on every member, for every member)")
    @argument("--gpus", default=None, metavar="SPEC",
              help="GPUs of this kernel for the workers it starts: 0,1 (one each), 0+1,2+3, "
                   "auto (round-robin) or none")
    @argument("--token", default=None, help="with --join tcp://HOST:PORT: the group's token")
    @argument("--port", type=int, default=None,
              help="meet over TCP on this port (0: any free one) instead of a private file")
    @argument("--host", default=None,
              help="with --port: the address to listen on (default 127.0.0.1)")
    @argument("--allow-remote", action="store_true",
              help="accept a --host that other machines can reach")
    @argument("--no-shm", action="store_true",
              help="move tensors over TensorPipe only, not rpcnb's shared memory")
    @argument("--ucx", action="store_true", default=None,
              help="move large tensors over UCX (pip install 'rpcnb[ucx]', or "
                   "'rpcnb[ucx-cu13]' for a CUDA 13 torch; also RPCNB_UCX=1)")
    @argument("--no-zero-copy", action="store_true",
              help="copy tensors already in shared memory too, instead of sending them by "
                   "handle (which shares their pages with the receiver)")
    @argument("--add", type=int, default=None, metavar="N",
              help="in a running group: start N more workers (with --gpus: their GPUs)")
    @argument("--engines", type=int, default=None, metavar="N",
              help="start an ipyparallel cluster of N engines; they become worker1..workerN")
    @argument("--launcher", default=None,
              help="with --engines: ipyparallel's launcher (local, mpi, ssh, slurm, pbs, lsf)")
    @argument("--cluster-args", default=None, metavar="ARGS",
              help="with --engines: ipyparallel settings as key=value items, e.g. "
                   "\"profile_dir=/tmp/p MPILauncher.mpi_args=['--oversubscribe']\"")
    @argument("--attach", default=None, metavar="CLUSTER",
              help="make the engines of a running ipyparallel cluster members (its id, "
                   "PROFILE:ID, a profile name or a profile directory)")
    @argument("--interface", default=None,
              help="the network interface TensorPipe listens on (default: the one that "
                   "owns --host, or that reaches the group's host)")
    @line_magic
    def rpc_init(self, line: str) -> None:
        """Start an RPC group with this kernel as worker0, or join one."""
        args = parse_init_line(line)
        if args.add is not None:
            return self._add(args)
        if (args.workers or 0) > 0 and not (args.join or args.engines or args.attach):
            # the workers' launcher imports torch while this kernel does (rpcnb.api
            # imports it); a start that fails before it forked a worker stops it again;
            # a missing extra starts nothing
            try:
                options.ucx_option(args.ucx)
            except errors.RpcnbError as exc:
                raise UsageError(str(exc)) from None
            launch.warm_up()
            try:
                return self._start_or_join(args)
            except BaseException:
                launch.stop_unused_launcher()
                raise
        return self._start_or_join(args)

    def _start_or_join(self, args: Any) -> None:
        from rpcnb import api

        kwargs: dict[str, Any] = {}
        if args.device_map is not None:
            kwargs["device_map"] = _device_map_spec(args.device_map, self._user_ns())
        elif options.applied_device_map() is not None:
            kwargs["device_map"] = options.applied_device_map()
        if args.threads is not None:
            kwargs["threads"] = args.threads
        if args.timeout is not None:
            kwargs["timeout"] = args.timeout
        try:
            clustered = args.engines is not None or args.attach is not None
            if (args.launcher or args.cluster_args) and args.engines is None:
                raise UsageError(errors.LAUNCHER_NEEDS_ENGINES)
            if clustered and (args.join or args.workers):
                raise UsageError(errors.ENGINES_AND_WORKERS if args.workers else
                                 "--engines/--attach start a group; --join joins one.")
            if args.engines is not None and args.attach is not None:
                raise UsageError("Give --engines N (a new cluster) or --attach CLUSTER, not both.")
            if args.join:
                if not args.name:
                    raise UsageError(JOIN_NEEDS_NAME)
                if args.workers:
                    raise UsageError(JOIN_NO_WORKERS)
                if args.channels or args.transports:
                    raise UsageError("--channels/--transports are set by the group's first kernel.")
                if args.port is not None or args.host or args.allow_remote:
                    raise UsageError(JOIN_NO_LISTEN)
                if args.gpus is not None:
                    raise UsageError(JOIN_NO_GPUS)
                group = api.join(args.join, args.name, token=args.token,
                                     shm=not args.no_shm, interface=args.interface,
                                     ucx=args.ucx, zero_copy=not args.no_zero_copy, **kwargs)
            else:
                if args.token:
                    raise UsageError("--token goes with --join; a new group makes its own.")
                if args.host and args.port is None:
                    raise UsageError("--host goes with --port: the address the group listens on.")
                if args.gpus is not None:
                    if clustered:
                        raise UsageError("--gpus is for --workers; engines use what they see.")
                    kwargs["gpus"] = args.gpus
                kwargs.update(name=args.name or "worker0", channels=_csv(args.channels),
                              transports=_csv(args.transports), shm=not args.no_shm,
                              ucx=args.ucx, zero_copy=not args.no_zero_copy,
                              port=args.port, host=args.host or "127.0.0.1",
                              allow_remote=args.allow_remote, interface=args.interface)
                if args.engines is not None:
                    from rpcnb.integrations import ipyparallel

                    group = ipyparallel.start(args.engines, args.launcher or "local",
                                          args.cluster_args, **kwargs)
                elif args.attach is not None:
                    from rpcnb.integrations import ipyparallel

                    group = ipyparallel.attach(args.attach, **kwargs)
                else:
                    group = api.init(args.workers, **kwargs)
        except (ValueError, errors.RpcnbError) as exc:
            raise UsageError(str(exc)) from None
        print(group)
        note = isolation.notice()  # once per kernel, when other users can reach the ports
        if note:
            print(note)

    def _add(self, args: Any) -> None:
        """%rpc_init --add N [--gpus SPEC]: nothing else goes with it."""
        from rpcnb import api

        others = [f for f in ("workers", "name", "join", "timeout", "threads", "channels",
                              "transports", "device_map", "token", "port", "host", "engines",
                              "launcher", "cluster_args", "attach", "interface")
                  if getattr(args, f) not in (None, 0)]
        if others or args.allow_remote or args.no_shm or args.ucx or args.no_zero_copy:
            raise UsageError(ADD_ALONE)
        if not state.is_initialized():
            raise UsageError(errors.NOT_INITIALIZED)
        try:
            print(api.add_workers(args.add, gpus=args.gpus))
        except (ValueError, errors.RpcnbError) as exc:
            raise UsageError(str(exc)) from None

    @magic_arguments()
    @argument("name", help="the worker to replace, e.g. worker1")
    @line_magic
    def rpc_restart(self, line: str) -> None:
        """Replace a dead or stuck worker with a fresh process (same name, GPUs, device
        map); its namespace starts empty and the RRefs it owned are lost."""
        args = _parse(self.rpc_restart, line)
        if not state.is_initialized():
            raise UsageError(errors.NOT_INITIALIZED)
        from rpcnb import api

        try:
            print(api.restart(args.name.strip()))
        except (ValueError, errors.RpcnbError) as exc:
            raise UsageError(str(exc)) from None

    @no_var_expand
    @_remote_args
    @line_cell_magic
    def remote(self, line: str, cell: str | None = None) -> Any:
        """Run a cell (or, as %remote WORKER EXPR, one expression) on worker(s)."""
        args, code = parse_remote_line(line, cell)
        return self._run(args, code)

    def _user_ns(self) -> dict[str, Any]:
        assert self.shell is not None
        return self.shell.user_ns

    def _run(self, args: Any, code: str) -> Any:
        from rpcnb import api

        user_ns = self._user_ns()
        push = {}
        for name in _csv(args.push) or []:
            if name not in user_ns:
                raise UsageError(PUSH_MISSING.format(name=name))
            push[name] = user_ns[name]
        target = state.ALL if args.all else args.target
        run = api.run_bg if args.bg else api.run
        try:
            result = run(target, code, fetch=args.fetch, push=push, timeout=args.timeout,
                         zero_copy=not args.copy)
        except (errors.WorkerDiedError, errors.RemoteError):
            raise  # they show the worker and what happened there
        except (ValueError, errors.RpcnbError) as exc:
            raise UsageError(str(exc)) from None
        if args.output:
            user_ns[args.output] = result
            if args.bg:
                print(BG_STARTED.format(id=result.id, workers=", ".join(result.workers),
                                        name=args.output))
            return None
        return result

    @line_magic
    def rpc_workers(self, line: str) -> Any:
        """The group now: names, hosts, pids, devices, alive, calls, recent latency."""
        from rpcnb import api

        if line.strip():
            raise UsageError("%rpc_workers takes no arguments.")
        try:
            return api.group()
        except errors.RpcnbError as exc:
            raise UsageError(str(exc)) from None

    @magic_arguments()
    @argument("--all", action="store_true", help="also the background cells that ended")
    @line_magic
    def rpc_jobs(self, line: str) -> Any:
        """Background cells (%%remote --bg) of this kernel: id, workers, status, seconds."""
        args = _parse(self.rpc_jobs, line)
        from rpcnb import api
        from rpcnb.cells.background import JobTable

        try:
            return JobTable(api.jobs(include_ended=args.all))
        except errors.RpcnbError as exc:
            raise UsageError(str(exc)) from None

    @magic_arguments()
    @argument("--timeout", type=float, default=10.0,
              help="seconds a worker gets to leave before it is stopped")
    @line_magic
    def rpc_shutdown(self, line: str) -> None:
        """Leave the group: workers first, this kernel last. Never hangs."""
        args = _parse(self.rpc_shutdown, line)
        if not state.is_initialized():
            raise UsageError(errors.NOT_INITIALIZED)
        from rpcnb import api

        api.shutdown(timeout=args.timeout)
        print("rpcnb: left the group; %rpc_init starts a new one.")

    # -- channels, probe and device maps (rpcnb.observe, rpcnb.frontend.widgets) --------------------

    @magic_arguments()
    @argument("workers", nargs="*", help="members to probe, by name (default: every other)")
    @argument("--sizes", default=None,
              help="message sizes, e.g. 1K,1M,256M (default: 1K to 256M, each x4)")
    @argument("--repeats", type=int, default=3, help="sends per size; the median is kept")
    @argument("--tensorpipe", action="store_true",
              help="keep large tensors on TensorPipe, off rpcnb's shared memory")
    @line_magic
    def rpc_probe(self, line: str) -> Any:
        """Round-trip latency and bandwidth to each peer, 1 KB to 256 MB; kept in telemetry."""
        args = _parse(self.rpc_probe, line)
        if not state.is_initialized():
            raise UsageError(errors.NOT_INITIALIZED)
        from rpcnb.observe import probe
        try:
            sizes = [probe.parse_size(x) for x in _csv(args.sizes) or []] or None
            workers = [w for item in args.workers for w in _csv(item) or []]
            return probe.probe(workers or None, sizes, args.repeats,
                               tensorpipe_only=args.tensorpipe)
        except (ValueError, errors.RpcnbError) as exc:
            raise UsageError(str(exc)) from None

    @magic_arguments()
    @argument("--json", action="store_true", help="print the findings as JSON, for scripts")
    @argument("--text", action="store_true", help="print the findings as text, no widget")
    @line_magic
    def rpc_doctor(self, line: str) -> Any:
        """Check every member (/dev/shm, ptrace scope, container, CUDA, InfiniBand, RDMA
        fork safety, interfaces, versions, clocks, the token's file) and say what to do."""
        args = _parse(self.rpc_doctor, line)
        if not state.is_initialized():
            raise UsageError(errors.NOT_INITIALIZED)
        from rpcnb.observe import doctor
        try:
            found = doctor.check()
        except errors.RpcnbError as exc:
            raise UsageError(str(exc)) from None
        if args.json:
            import json

            print(json.dumps(doctor.to_json(found), indent=1))
            return None
        if not args.text:
            try:
                from rpcnb.frontend.widgets.doctor_report import DoctorReport
            except ImportError:  # without anywidget the text is the whole report
                pass
            else:
                return DoctorReport(found)  # its plain-text form is the text below
        print(doctor.describe(found))
        return None

    @magic_arguments()
    @argument("--interval", type=float, default=0.5,
              help="seconds between updates at most (default 0.5)")
    @argument("--text", action="store_true", help="print the predicted channels, no widget")
    @line_magic
    def rpc_channels(self, line: str) -> Any:
        """The channel monitor: predicted paths, measured latency and bandwidth per pair."""
        args = _parse(self.rpc_channels, line)
        if not state.is_initialized():
            raise UsageError(errors.NOT_INITIALIZED)
        from rpcnb.observe import channels
        if args.interval <= 0:
            raise UsageError(f"--interval must be a positive number of seconds, not {args.interval}.")
        try:
            if args.text:
                from rpcnb import telemetry

                print(channels.describe(channels.predict_group())
                      + channels.describe_ucx(channels.ucx_paths()))
                paths = channels.describe_paths(telemetry.peer_stats())
                if paths:
                    print("\n" + paths)
                return None
            try:
                from rpcnb.frontend.widgets.channel_monitor import ChannelMonitor
            except ImportError:
                from rpcnb.frontend.widgets import NEEDS_ANYWIDGET

                print(channels.describe(channels.predict_group()))
                raise UsageError(NEEDS_ANYWIDGET) from None
            return ChannelMonitor(interval=args.interval)
        except (ValueError, errors.RpcnbError) as exc:
            raise UsageError(str(exc)) from None

    @magic_arguments()
    @argument("--topology", default=None, metavar="SPEC",
              help="declared CUDA devices per member, e.g. worker0=2,worker1=2 (to plan)")
    @argument("--name", default=None, help="without a group: the member the map is for")
    @line_magic
    def rpc_devmap(self, line: str) -> Any:
        """The device-map editor; 'apply' keeps the map for the next %rpc_init / --join."""
        args = _parse(self.rpc_devmap, line)
        topology: Any = None
        if args.topology is not None:
            topology = _device_map_spec(args.topology, self._user_ns())
        try:
            from rpcnb.frontend.widgets.devmap_editor import DeviceMapEditor
        except ImportError:
            from rpcnb.frontend.widgets import NEEDS_ANYWIDGET

            raise UsageError(NEEDS_ANYWIDGET) from None
        try:
            return DeviceMapEditor(topology=topology, me=args.name)
        except (ValueError, errors.RpcnbError) as exc:
            raise UsageError(str(exc)) from None
