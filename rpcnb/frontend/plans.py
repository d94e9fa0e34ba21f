"""What a magic's line asks for, decided without a kernel: the flags of each magic written
once (as decorators, the way ipyparallel shares flags between its magics), the parsers of
``%rpc_init`` and ``%remote``/``%%remote``, and ``plan_init``, which turns ``%rpc_init``'s
line into the one API call it stands for. Nothing here starts or asks anything; a line
that cannot be carried out is a ``UsageError`` with one sentence that says what to do.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

from rpcnb import errors
from rpcnb.wire import options

NO_TARGET = "Name the worker(s) to run on, e.g. %%remote worker1 or %%remote worker1,worker2, or use --all."
NO_EXPR = "Give the expression to run: %remote worker1 EXPR (or use %%remote for a whole cell)."
TARGET_AND_ALL = "Give either --all or worker names ({target!r}), not both."
BAD_OUTPUT_NAME = "-o {name!r} is not a valid Python variable name."
BAD_TIMEOUT = "--timeout must be a positive number of seconds, not {timeout}."
UNREADABLE = "Cannot read the magic's arguments ({reason}): check the quotes."
JOIN_NEEDS_NAME = "--join needs --name: the name this kernel takes in the group, e.g. --name alice."
JOIN_NO_WORKERS = "--join and --workers do not go together: the group's first kernel starts the workers."
JOIN_NO_LISTEN = "--port/--host/--allow-remote are for the group's first kernel, not with --join."
JOIN_NO_GPUS = (
    "--gpus picks GPUs for the workers the group's first kernel starts; a joining kernel "
    "uses what it sees (set CUDA_VISIBLE_DEVICES before starting it)."
)
JOIN_NO_CHANNELS = "--channels/--transports are set by the group's first kernel."
CLUSTER_OR_JOIN = "--engines/--attach start a group; --join joins one."
ENGINES_OR_ATTACH = "Give --engines N (a new cluster) or --attach CLUSTER, not both."
TOKEN_WITH_JOIN = "--token goes with --join; a new group makes its own."
HOST_WITH_PORT = "--host goes with --port: the address the group listens on."
GPUS_NOT_ENGINES = "--gpus is for --workers; engines use what they see."
ADD_ALONE = "--add N goes alone (or with --gpus for the added workers): %rpc_init --add 2."

# Options of the remote magics that take a value (for splitting the line form).
_VALUED = {"-o", "--push", "--timeout"}


def _stack(decorators: list[Callable[[Any], Any]]) -> Callable[[Any], Any]:
    def apply(func: Any) -> Any:
        for deco in reversed(decorators):
            func = deco(func)
        return func
    return apply


init_flags = _stack([
    magic_arguments(),
    argument("--workers", type=int, default=0, help="start this many worker processes"),
    argument("--name", default=None, help="this kernel's name in the group"),
    argument("--join", default=None, metavar="ADDR", help="join the group at ADDR"),
    argument("--timeout", type=float, default=None, help="RPC timeout in seconds (default 60)"),
    argument("--threads", type=int, default=None, help="RPC threads per process (default 16)"),
    argument("--channels", default=None, help="TensorPipe channels to allow, e.g. basic,cma"),
    argument("--transports", default=None, help="TensorPipe transports to allow, e.g. uv,shm"),
    argument("--device-map", default=None, metavar="SPEC",
             help="this kernel's device map: {'worker1': {0: 1}}, DI-engine's 1_0_1,2_0_2, "
                  "or auto (every GPU to the same index on every member, for every member)"),
    argument("--gpus", default=None, metavar="SPEC",
             help="GPUs of this kernel for the workers it starts: 0,1 (one each), 0+1,2+3, "
                  "auto (round-robin) or none"),
    argument("--token", default=None, help="with --join tcp://HOST:PORT: the group's token"),
    argument("--port", type=int, default=None,
             help="meet over TCP on this port (0: any free one) instead of a private file"),
    argument("--host", default=None,
             help="with --port: the address to listen on (default 127.0.0.1)"),
    argument("--allow-remote", action="store_true",
             help="accept a --host that other machines can reach"),
    argument("--no-shm", action="store_true",
             help="move tensors over TensorPipe only, not rpcnb's shared memory"),
    argument("--ucx", action="store_true", default=None,
             help="move large tensors over UCX (pip install 'rpcnb[ucx]', or "
                  "'rpcnb[ucx-cu13]' for a CUDA 13 torch; also RPCNB_UCX=1)"),
    argument("--no-zero-copy", action="store_true",
             help="copy tensors already in shared memory too, instead of sending them by "
                  "handle (which shares their pages with the receiver)"),
    argument("--collectives", default=None, choices=["gloo", "nccl", "auto"],
             help="the workers also form a torch.distributed process group (worker1 is "
                  "rank 0) for all_reduce, barrier, DDP; auto: nccl where every worker has "
                  "a GPU of its own, else gloo"),
    argument("--collective-timeout", type=float, default=None, metavar="S",
             help="with --collectives: seconds a collective waits for every rank "
                  "(default 60)"),
    argument("--add", type=int, default=None, metavar="N",
             help="in a running group: start N more workers (with --gpus: their GPUs)"),
    argument("--engines", type=int, default=None, metavar="N",
             help="start an ipyparallel cluster of N engines; they become worker1..workerN"),
    argument("--launcher", default=None,
             help="with --engines: ipyparallel's launcher (local, mpi, ssh, slurm, pbs, lsf)"),
    argument("--cluster-args", default=None, metavar="ARGS",
             help="with --engines: ipyparallel settings as key=value items, e.g. "
                  "\"profile_dir=/tmp/p MPILauncher.mpi_args=['--oversubscribe']\""),
    argument("--attach", nargs="?", const="", default=None, metavar="GROUP",
             help="attach to a kept group again (alone: the one there is; or its name), "
                  "or make the engines of a running ipyparallel cluster members (its id, "
                  "PROFILE:ID, a profile name or a profile directory)"),
    argument("--keep", nargs="?", const="", default=None, metavar="DURATION",
             help="with --workers: the workers outlive this kernel (a restart, a crash) "
                  "until no kernel has been attached for DURATION (default 1h; 30m, 2h); "
                  "--attach attaches again"),
    argument("--interface", default=None,
             help="the network interface TensorPipe listens on (default: the one that "
                  "owns --host, or that reaches the group's host)"),
])

remote_flags = _stack([
    magic_arguments(),
    argument("target", nargs="?", default=None,
             help="a worker, or a worker set: worker1-8, worker2,worker5-7, @HOST"),
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
    argument("--local", action="store_true",
             help="also run the cell here, in the notebook (its result is under 'local')"),
    argument("--profile", action="store_true",
             help="run the cell under torch.profiler on each worker: its top operators, "
                  "and its trace file (Chrome/Perfetto) on this host"),
])


@init_flags
def rpc_init(line: str) -> None:
    """Start an RPC group with this kernel as worker0, or join one."""


@remote_flags
def remote(line: str, cell: str | None = None) -> None:
    """Run a cell (or, as %remote WORKER EXPR, one expression) on worker(s)."""


def flags_of(func: Any) -> dict[str, bool]:
    """A magic's flags as its parser declares them (``func`` carries the parser), each with
    whether it takes a value: what Tab offers on the magic's line (``rpcnb.frontend.completion``)."""
    return {opt: action.nargs != 0 for action in func.parser._actions
            for opt in action.option_strings}


def csv(text: str | None) -> list[str] | None:
    """'a, b,,c' -> ['a', 'b', 'c']; None stays None."""
    if text is None:
        return None
    return [p.strip() for p in text.split(",") if p.strip()]


def parse(func: Any, line: str) -> Any:
    """A magic's flags from its line (``func`` carries the parser); a UsageError when the
    line cannot be read."""
    try:
        return parse_argstring(func, line)
    except ValueError as exc:  # e.g. an unbalanced quote
        raise UsageError(UNREADABLE.format(reason=exc)) from None


def split_line_form(line: str) -> tuple[str, str]:
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


def parse_init_line(line: str) -> Any:
    """%rpc_init's flags; a UsageError for anything malformed."""
    return parse(rpc_init, line)


def parse_remote_line(line: str, cell: str | None) -> tuple[Any, str]:
    """%remote / %%remote's flags and code; a UsageError for anything malformed."""
    if cell is None:
        flags, code = split_line_form(line)
        args = parse(remote, flags)
        if not code.strip():
            raise UsageError(NO_EXPR)
    else:
        args = parse(remote, line)
        code = cell
    if args.all and args.target:
        raise UsageError(TARGET_AND_ALL.format(target=args.target))
    if not args.all and not args.target:
        raise UsageError(NO_TARGET)
    if args.output is not None and not args.output.isidentifier():
        raise UsageError(BAD_OUTPUT_NAME.format(name=args.output))
    if args.timeout is not None and not args.timeout > 0:
        raise UsageError(BAD_TIMEOUT.format(timeout=args.timeout))
    return args, code


@dataclass(frozen=True)
class InitPlan:
    """The one API call a ``%rpc_init`` line stands for.

    ``action`` is ``"init"`` (``rpcnb.init(workers, **kwargs)``), ``"join"``
    (``rpcnb.join(address, name, **kwargs)``), ``"engines"`` (an ipyparallel cluster of
    ``workers`` engines with ``launcher`` and ``cluster_args``), ``"attach"`` (the engines
    of the cluster ``address``) or ``"add"`` (``rpcnb.add_workers(workers, **kwargs)``).
    """

    action: str
    workers: int = 0
    address: str | None = None
    name: str | None = None
    launcher: str | None = None
    cluster_args: str | None = None
    kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def starts_workers(self) -> bool:
        """Whether this kernel's warm launcher will fork worker processes for it."""
        return self.action == "init" and self.workers > 0


def kept_duration(text: str) -> float:
    """--keep's DURATION in seconds (empty: the default hour); ValueError if it is none."""
    from rpcnb.membership import kept

    return kept.duration(text)


def device_map_spec(text: str, namespace: Mapping[str, Any]) -> Any:
    """--device-map takes a dict literal, DI-engine's string, or a notebook variable."""
    try:
        return options.device_map_spec(text, dict(namespace))
    except ValueError as exc:
        raise UsageError(str(exc)) from None


_ADD_ALONE_FLAGS = ("workers", "name", "join", "timeout", "threads", "channels", "transports",
                    "device_map", "token", "port", "host", "engines", "launcher", "cluster_args",
                    "attach", "interface")


def plan_init(line: str, namespace: Mapping[str, Any] | None = None,
              applied_device_map: dict[str, Any] | None = None) -> InitPlan:
    """``%rpc_init``'s line as the call it stands for, every flag checked against the
    others. ``namespace`` is where a ``--device-map`` variable is looked up;
    ``applied_device_map`` is the map the device-map editor kept (``%rpc_devmap``), used
    when the line names none."""
    args = parse_init_line(line)
    if args.add is not None:
        return _plan_add(args)
    kwargs = _call_kwargs(args, namespace or {}, applied_device_map)
    kwargs.update(_group_kwargs(args))
    _check_cluster(args)
    if args.join:
        return _plan_join(args, kwargs)
    return _plan_start(args, kwargs)


def _clustered(args: Any) -> bool:
    """Whether the line starts an ipyparallel cluster's engines or attaches to one."""
    return args.engines is not None or args.attach is not None


def _plan_add(args: Any) -> InitPlan:
    """``--add N``: only ``--gpus`` goes with it."""
    others = [f for f in _ADD_ALONE_FLAGS if getattr(args, f) not in (None, 0)]
    if others or args.allow_remote or args.no_shm or args.ucx or args.no_zero_copy \
            or args.collectives:
        raise UsageError(ADD_ALONE)
    return InitPlan("add", workers=args.add, kwargs={"gpus": args.gpus})


def _call_kwargs(args: Any, namespace: Mapping[str, Any],
                 applied_device_map: dict[str, Any] | None) -> dict[str, Any]:
    """What every kind of start passes on: the device map, the threads, the timeout."""
    kwargs: dict[str, Any] = {}
    if args.device_map is not None:
        kwargs["device_map"] = device_map_spec(args.device_map, namespace)
    elif applied_device_map is not None:
        kwargs["device_map"] = applied_device_map
    if args.threads is not None:
        kwargs["threads"] = args.threads
    if args.timeout is not None:
        kwargs["timeout"] = args.timeout
    return kwargs


def _group_kwargs(args: Any) -> dict[str, Any]:
    """``--collectives`` and ``--keep``: only for a group whose workers this kernel starts."""
    kwargs: dict[str, Any] = {}
    if args.collective_timeout is not None and not args.collectives:
        raise UsageError("--collective-timeout goes with --collectives.")
    if args.collectives and (args.join or _clustered(args)):
        raise UsageError(errors.COLLECTIVES_NOT_HERE)
    if args.collectives and not args.workers:
        raise UsageError(errors.COLLECTIVES_NEED_WORKERS)
    if args.keep is not None:
        if args.join or _clustered(args) or not args.workers:
            raise UsageError(errors.KEEP_NEEDS_WORKERS)
        try:
            kwargs["keep"] = kept_duration(args.keep)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
    if args.collectives:
        kwargs["collectives"] = args.collectives
        if args.collective_timeout is not None:
            kwargs["collective_timeout"] = args.collective_timeout
    return kwargs


def _check_cluster(args: Any) -> None:
    """An ipyparallel cluster's flags: ``--engines`` or ``--attach``, alone."""
    if (args.launcher or args.cluster_args) and args.engines is None:
        raise UsageError(errors.LAUNCHER_NEEDS_ENGINES)
    if _clustered(args) and (args.join or args.workers):
        raise UsageError(errors.ENGINES_AND_WORKERS if args.workers else CLUSTER_OR_JOIN)
    if args.engines is not None and args.attach is not None:
        raise UsageError(ENGINES_OR_ATTACH)


def _plan_join(args: Any, kwargs: dict[str, Any]) -> InitPlan:
    """``--join ADDR --name NAME``: none of what only a group's first kernel decides."""
    if not args.name:
        raise UsageError(JOIN_NEEDS_NAME)
    if args.workers:
        raise UsageError(JOIN_NO_WORKERS)
    if args.channels or args.transports:
        raise UsageError(JOIN_NO_CHANNELS)
    if args.port is not None or args.host or args.allow_remote:
        raise UsageError(JOIN_NO_LISTEN)
    if args.gpus is not None:
        raise UsageError(JOIN_NO_GPUS)
    kwargs.update(token=args.token, shm=not args.no_shm, interface=args.interface,
                  ucx=args.ucx, zero_copy=not args.no_zero_copy)
    return InitPlan("join", address=args.join, name=args.name, kwargs=kwargs)


def _plan_start(args: Any, kwargs: dict[str, Any]) -> InitPlan:
    """A new group: with ``--workers`` (``init``), an ipyparallel cluster's ``--engines``,
    or the engines of a running one (``--attach``)."""
    if args.token:
        raise UsageError(TOKEN_WITH_JOIN)
    if args.host and args.port is None:
        raise UsageError(HOST_WITH_PORT)
    if args.gpus is not None:
        if _clustered(args):
            raise UsageError(GPUS_NOT_ENGINES)
        kwargs["gpus"] = args.gpus
    kwargs.update(name=args.name or "worker0", channels=csv(args.channels),
                  transports=csv(args.transports), shm=not args.no_shm,
                  ucx=args.ucx, zero_copy=not args.no_zero_copy,
                  port=args.port, host=args.host or "127.0.0.1",
                  allow_remote=args.allow_remote, interface=args.interface)
    if args.engines is not None:
        return InitPlan("engines", workers=args.engines, launcher=args.launcher or "local",
                        cluster_args=args.cluster_args, kwargs=kwargs)
    if args.attach is not None:
        return InitPlan("attach", address=args.attach, kwargs=kwargs)
    return InitPlan("init", workers=args.workers, kwargs=kwargs)
