"""The IPython magics: parse the line, call the API, display. No RPC logic here.

What a line asks for is decided in ``rpcnb.frontend.plans`` (pure, tested without a kernel);
each magic here carries it out. ``usage_errors`` turns the API's ``ValueError`` and
``RpcnbError`` into a one-line ``UsageError`` (a remote cell's own error and a dead worker
are shown as they are), and ``needs_group`` says "run %rpc_init first".
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, line_magic, magics_class, no_var_expand
from IPython.core.magic_arguments import argument, magic_arguments

from rpcnb import errors
from rpcnb.frontend import plans
from rpcnb.frontend.plans import parse, parse_init_line, parse_remote_line
from rpcnb.procs import launch
from rpcnb.sandbox import isolation
from rpcnb.session import state
from rpcnb.wire import options

__all__ = ["RpcMagics", "parse_init_line", "parse_remote_line"]

PUSH_MISSING = "--push: there is no variable {name!r} in this notebook to send."
BG_PROFILE = "--profile shows its tables when the cell ends: drop --bg to profile a cell."
BG_LOCAL = ("--local runs the cell in the notebook too, which cannot go to the background: "
            "drop --bg, or run the cell here in a cell of its own.")
BG_STARTED = (
    "rpcnb: background cell [{id}] on {workers} started; its output comes here. "
    "{name}.result() when it ends, {name}.cancel() to stop it, %rpc_jobs lists them."
)
NO_ARGUMENTS = "%rpc_workers takes no arguments."
KEPT_ENDED = "rpcnb: kept group {group} ended: its workers are stopped, nothing is left."
BAD_INTERVAL = "--interval must be a positive number of seconds, not {interval}."


def usage_errors(method: Callable[..., Any]) -> Callable[..., Any]:
    """A ``ValueError`` or ``RpcnbError`` from the API (bad input, no such worker, no
    group) becomes a one-line ``UsageError``; a remote cell's error and a dead or
    unreachable worker pass as they are, since they show the worker and what happened there."""
    @functools.wraps(method)
    def magic(*args: Any, **kwargs: Any) -> Any:
        try:
            return method(*args, **kwargs)
        except (errors.WorkerDiedError, errors.WorkerUnreachableError, errors.RemoteError):
            raise
        except (ValueError, errors.RpcnbError) as exc:
            raise UsageError(str(exc)) from None
    return magic


def needs_group(method: Callable[..., Any]) -> Callable[..., Any]:
    """"run %rpc_init first", before the magic does anything, where there is no group."""
    @functools.wraps(method)
    def magic(*args: Any, **kwargs: Any) -> Any:
        if not state.is_initialized():
            raise UsageError(errors.NOT_INITIALIZED)
        return method(*args, **kwargs)
    return magic


def kept_group(address: str | None) -> bool:
    """Whether --attach names a kept group (or nothing: the one there is), not a cluster."""
    if not address:
        return True
    from rpcnb.membership import kept

    return kept.read(address) is not None


@magics_class
class RpcMagics(Magics):
    """%rpc_init, %%remote, %remote, %rpc_workers, %rpc_shutdown."""

    @plans.init_flags
    @usage_errors
    @line_magic
    def rpc_init(self, line: str) -> None:
        """Start an RPC group with this kernel as worker0, or join one."""
        plan = plans.plan_init(line, self._user_ns(), options.applied_device_map())
        if plan.action == "add":
            return self._add(plan)
        if not plan.starts_workers:
            return self._start(plan)
        # the workers' launcher imports torch while this kernel does (rpcnb.api imports
        # it); a start that fails before it forked a worker stops it again; a missing
        # extra starts nothing
        options.ucx_option(plan.kwargs["ucx"])
        launch.warm_up()
        try:
            return self._start(plan)
        except BaseException:
            launch.stop_unused_launcher()
            raise

    def _start(self, plan: plans.InitPlan) -> None:
        from rpcnb import api

        if plan.action == "join":
            assert plan.address is not None and plan.name is not None
            group = api.join(plan.address, plan.name, **plan.kwargs)
        elif plan.action == "attach" and kept_group(plan.address):
            group = api.attach(plan.address or None, name=plan.kwargs.get("name")
                               if plan.kwargs.get("name") != "worker0" else None)
        elif plan.action in ("engines", "attach"):
            from rpcnb.integrations import ipyparallel

            if plan.action == "engines":
                group = ipyparallel.start(plan.workers, plan.launcher or "local",
                                          plan.cluster_args, **plan.kwargs)
            else:
                group = ipyparallel.attach(plan.address, **plan.kwargs)
        else:
            group = api.init(plan.workers, **plan.kwargs)
        print(group)
        note = isolation.notice()  # once per kernel, when other users can reach the ports
        if note:
            print(note)

    @needs_group
    def _add(self, plan: plans.InitPlan) -> None:
        """%rpc_init --add N [--gpus SPEC]: nothing else goes with it."""
        from rpcnb import api

        print(api.add_workers(plan.workers, **plan.kwargs))

    @magic_arguments()
    @argument("name", help="the worker to replace, e.g. worker1; or a set, worker1-4")
    @usage_errors
    @line_magic
    def rpc_restart(self, line: str) -> None:
        """Replace a dead or stuck worker with a fresh process (same name, GPUs, device
        map); its namespace starts empty and the RRefs it owned are lost."""
        args = parse(self.rpc_restart, line)
        self._restart(args.name.strip())

    @needs_group
    def _restart(self, name: str) -> None:
        from rpcnb import api

        print(api.restart(name))

    @no_var_expand
    @plans.remote_flags
    @usage_errors
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
        for name in plans.csv(args.push) or []:
            if name not in user_ns:
                raise UsageError(PUSH_MISSING.format(name=name))
            push[name] = user_ns[name]
        target = state.ALL if args.all else args.target
        if args.bg and (args.local or args.profile):
            raise UsageError(BG_LOCAL if args.local else BG_PROFILE)
        if args.bg:
            result = api.run_bg(target, code, fetch=args.fetch, push=push, timeout=args.timeout,
                                zero_copy=not args.copy)
        else:
            result = api.run(target, code, fetch=args.fetch, push=push, timeout=args.timeout,
                             zero_copy=not args.copy, local=args.local, profile=args.profile)
        if args.output:
            user_ns[args.output] = result
            if args.bg:
                print(BG_STARTED.format(id=result.id, workers=", ".join(result.workers),
                                        name=args.output))
            return None
        return result

    @usage_errors
    @line_magic
    def rpc_workers(self, line: str) -> Any:
        """The group now: names, hosts, pids, devices, alive, calls, recent latency."""
        from rpcnb import api

        if line.strip():
            raise UsageError(NO_ARGUMENTS)
        return api.group()

    @magic_arguments()
    @argument("--all", action="store_true", help="also the background cells that ended")
    @argument("id", nargs="?", type=int, default=None,
              help="one cell: its row, what it printed while no kernel was attached, its end")
    @usage_errors
    @line_magic
    def rpc_jobs(self, line: str) -> Any:
        """Background cells (%%remote --bg) of this kernel: id, workers, status, seconds.
        %rpc_jobs ID: that cell, with what it printed while no kernel was attached (a cell
        taken over from a kept group's earlier kernel) and its result or error."""
        args = parse(self.rpc_jobs, line)
        from rpcnb import api
        from rpcnb.cells.background import JobTable, show

        if args.id is not None:
            show(args.id)
            return None
        return JobTable(api.jobs(include_ended=args.all))

    @magic_arguments()
    @argument("--timeout", type=float, default=10.0,
              help="seconds a worker gets to leave before it is stopped")
    @argument("--group", default=None,
              help="end this kept group (rpc_groups lists them) without attaching to it")
    @usage_errors
    @line_magic
    def rpc_shutdown(self, line: str) -> None:
        """Leave the group: workers first, this kernel last (a kept group ends too). Never
        hangs. --group NAME ends a kept group without attaching to it."""
        args = parse(self.rpc_shutdown, line)
        if args.group is not None:
            from rpcnb import api

            api.end_group(args.group, timeout=args.timeout)
            print(KEPT_ENDED.format(group=args.group))
            return
        self._shutdown(args.timeout)

    @magic_arguments()
    @usage_errors
    @line_magic
    def rpc_groups(self, line: str) -> None:
        """The kept groups of this user (%rpc_init --keep): workers, since when, the
        kernel attached or for how long none is, memory and GPU memory."""
        parse(self.rpc_groups, line)
        from rpcnb.membership import kept

        print(kept.table(kept.groups()))

    @needs_group
    def _shutdown(self, timeout: float) -> None:
        from rpcnb import api

        api.shutdown(timeout=timeout)
        print("rpcnb: left the group; %rpc_init starts a new one.")

    # -- channels, probe and device maps (rpcnb.observe, rpcnb.frontend.widgets) --------------------

    @magic_arguments()
    @argument("workers", nargs="*",
              help="members to probe: names or sets, worker1-8 (default: every other)")
    @argument("--sizes", default=None,
              help="message sizes, e.g. 1K,1M,256M (default: 1K to 256M, each x4)")
    @argument("--repeats", type=int, default=3, help="sends per size; the median is kept")
    @argument("--tensorpipe", action="store_true",
              help="keep large tensors on TensorPipe, off rpcnb's shared memory")
    @usage_errors
    @line_magic
    def rpc_probe(self, line: str) -> Any:
        """Round-trip latency and bandwidth to each peer, 1 KB to 256 MB; kept in telemetry."""
        return self._probe(parse(self.rpc_probe, line))

    @needs_group
    def _probe(self, args: Any) -> Any:
        from rpcnb.observe import probe

        sizes = [probe.parse_size(x) for x in plans.csv(args.sizes) or []] or None
        workers = [w for item in args.workers for w in plans.csv(item) or []]
        return probe.probe(workers or None, sizes, args.repeats, tensorpipe_only=args.tensorpipe)

    @magic_arguments()
    @argument("workers", nargs="*",
              help="workers to list: names or sets, worker1-8 (default: every other member)")
    @usage_errors
    @line_magic
    def rpc_who(self, line: str) -> Any:
        """Each worker's variables: type, and for tensors and arrays shape, dtype, device
        and size."""
        return self._who(parse(self.rpc_who, line))

    @needs_group
    def _who(self, args: Any) -> Any:
        from rpcnb import api

        return api.who([w for item in args.workers for w in plans.csv(item) or []] or None)

    @magic_arguments()
    @argument("workers", nargs="*",
              help="members to show: names or sets, worker1-8 (default: every other)")
    @argument("--all", action="store_true", help="every member, this kernel included")
    @argument("--full", action="store_true",
              help="every frame of every thread: rpcnb's around the cell, the idle threads'")
    @argument("--timeout", type=float, default=1.0,
              help="seconds each member gets to answer (default 1)")
    @usage_errors
    @line_magic
    def rpc_stacks(self, line: str) -> Any:
        """Where each member is now: every thread's Python stack, the running cell's first."""
        return self._stacks(parse(self.rpc_stacks, line))

    @needs_group
    def _stacks(self, args: Any) -> Any:
        from rpcnb.observe import stacks

        workers = [w for item in args.workers for w in plans.csv(item) or []]
        if workers and args.all:
            raise UsageError(plans.TARGET_AND_ALL.format(target=",".join(workers)))
        return stacks.stacks(workers or None, every=args.all, full=args.full,
                             timeout=args.timeout)

    @magic_arguments()
    @argument("--json", action="store_true", help="print the findings as JSON, for scripts")
    @argument("--text", action="store_true", help="print the findings as text, no widget")
    @usage_errors
    @line_magic
    def rpc_doctor(self, line: str) -> Any:
        """Check every member (/dev/shm, ptrace scope, container, CUDA, InfiniBand, RDMA
        fork safety, interfaces, versions, clocks, the token's file) and the user's kept
        groups, and say what to do."""
        return self._doctor(parse(self.rpc_doctor, line))

    @needs_group
    def _doctor(self, args: Any) -> Any:
        from rpcnb.membership import kept
        from rpcnb.observe import doctor

        found = doctor.check() + kept.findings()  # the user's kept groups last
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
    @usage_errors
    @line_magic
    def rpc_channels(self, line: str) -> Any:
        """The channel monitor: predicted paths, measured latency and bandwidth per pair."""
        return self._channels(parse(self.rpc_channels, line))

    @needs_group
    def _channels(self, args: Any) -> Any:
        from rpcnb.observe import channels

        if args.interval <= 0:
            raise UsageError(BAD_INTERVAL.format(interval=args.interval))
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

    @magic_arguments()
    @argument("--topology", default=None, metavar="SPEC",
              help="declared CUDA devices per member, e.g. worker0=2,worker1=2 (to plan)")
    @argument("--name", default=None, help="without a group: the member the map is for")
    @usage_errors
    @line_magic
    def rpc_devmap(self, line: str) -> Any:
        """The device-map editor; 'apply' keeps the map for the next %rpc_init / --join."""
        args = parse(self.rpc_devmap, line)
        topology: Any = None
        if args.topology is not None:
            topology = plans.device_map_spec(args.topology, self._user_ns())
        try:
            from rpcnb.frontend.widgets.devmap_editor import DeviceMapEditor
        except ImportError:
            from rpcnb.frontend.widgets import NEEDS_ANYWIDGET

            raise UsageError(NEEDS_ANYWIDGET) from None
        return DeviceMapEditor(topology=topology, me=args.name)
