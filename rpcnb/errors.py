"""Errors rpcnb raises, and the one-sentence messages behind them.

The sentences are module constants so tests (and docs/troubleshooting.md) can match them.
"""

from __future__ import annotations

import re
from typing import Any, NoReturn

from rpcnb import docs, text

NOT_INITIALIZED = "This process is not in an RPC group yet: run %rpc_init (or rpcnb.init()) first."
ALREADY_INITIALIZED = (
    "This process is already in an RPC group as {name!r}: run %rpc_shutdown first, "
    "then %rpc_init again."
)
UNKNOWN_WORKER = "There is no worker {name!r} in the group; known workers: {known}. Check %rpc_workers."
BAD_TARGET = (
    "A worker is named by its name: got {got} ({kind}){hint}. Give 'worker1', 'worker1,worker2', "
    "a list of names, or rpcnb.ALL; %rpc_workers lists the names."
)
NO_WORKERS = "The group has no workers besides this one: start some with %rpc_init --workers N."
EMPTY_CELL = "The cell is empty: write the code to run on {target} below the %%remote line."
NAME_TAKEN = (
    "The name {name!r} is already taken in this group (names are never reused): "
    "pick another with --name."
)
NAME_CLASH = (
    "--name {name!r} clashes with the name of a started worker (worker1..worker{n}): "
    "pick a name that is not workerK."
)
BAD_NAME = (
    "{name!r} is not a valid worker name: use letters, digits and '_' only, starting with a "
    "letter or '_' (at most 64 characters). Not '-': torch splits a member's name from its "
    "rank at '-', and every member that joins later would wait for a name cut in two."
)
JOIN_NOT_FOUND = (
    "No rpcnb group answers at {addr!r}: check the address printed by %rpc_init on the "
    "group's first kernel, and that the group is still running."
)
WORKER_DIED = "Worker {name!r} died ({how}); its namespace is lost. The rest of the group keeps working."
WORKER_LEFT = "Worker {name!r} has left the group; start a new worker under a new name."
# torch's rpc.api._all_gather, _barrier, _wait_all_workers (rpcnb.wire._gather)
GATHER_GONE = ("torch's rpc.api.{what} across {names} cannot finish (call it again with the "
               "members there are now: %rpc_workers): {said}")
NOT_A_MEMBER = "{name!r} is not a member of the group now (its members: {known})."
WORKER_UNREACHABLE = (
    "Worker {name!r} on {host} is unreachable since {since} ({ago:.0f} s): nothing from its "
    "host arrives, not even TCP acknowledgements, so the network between here and there is "
    "down or the host is lost. It is not known to be dead: it keeps its namespace and "
    "answers again on its own when the network is back (%rpc_workers shows it), and a cell "
    "it was running for you may still run there (later cells wait behind it). The rest of "
    "the group keeps working; if the host is gone for good, %rpc_shutdown ends the group "
    "without it."
)
CALL_TIMEOUT = (
    "The remote cell on {name!r} did not finish within {timeout:g} s and was interrupted; "
    "raise --timeout if it needs longer."
)
CALL_TIMEOUT_RUNNING = (
    "The remote cell on {name!r} did not finish within {timeout:g} s and did not stop "
    "{grace:g} s after it was interrupted: it is still running there (in code that does not "
    "check for interrupts, such as one long C call). Cells sent to it wait behind it. "
    "Wait for it, or %rpc_restart {first} to replace the worker (its namespace is lost)."
)
KEEP_DURATION = (
    "--keep takes how long the group may go without a kernel: 90, 90s, 30m, 2h or 1d (a "
    "number above 0), not {value!r}."
)
KEEP_NEEDS_WORKERS = "--keep keeps workers: give --workers N (N of 1 or more) with it."
KEPT_NONE = (
    "There is no kept group to attach to: %rpc_init --workers N --keep starts one (its "
    "workers outlive the kernel); %rpc_groups lists them."
)
KEPT_NONE_LISTED = "No kept groups (%rpc_init --workers N --keep starts one)."
KEPT_WHICH = "There are several kept groups ({known}): name one, e.g. %rpc_init --attach NAME."
KEPT_UNKNOWN = "There is no kept group {name!r}; kept groups: {known} (%rpc_groups lists them)."
KEPT_ATTACHED = (
    "Kept group {group!r} has a kernel attached already: {kernel} (pid {pid}). One kernel "
    "drives a kept group at a time: %rpc_shutdown there (it ends the group), or close that "
    "kernel, then attach here."
)
KEEPER_FAILED = "The kept group could not start: {reason}. The keeper's log ends with:\n{log}"
KEPT_ATTACHED_TO = (
    "rpcnb: attached to kept group {group} in {seconds:.1f} s ({idle}): {workers} kept "
    "their names, namespaces and running cells."
)
KEPT_BUSY = "rpcnb: {worker} runs {cell} (for {seconds:.0f} s)"
KEPT_DIED = "rpcnb: {worker} died while no kernel was attached ({how}); its namespace is lost."
KEPT_NOT_KEPT = (
    "rpcnb: not kept from the kernel before: the RRefs it held (their values stay on the "
    "workers, under the names the cells gave them), its notebook variables (what it "
    "--push'ed stays on the workers) and its collectives. Its cells that ran on are this "
    "kernel's background cells now (below, and %rpc_jobs). %rpc_shutdown ends the kept "
    "group; leaving the kernel keeps it."
)
KEPT_IDLE_TODO = (
    "it holds its workers' memory while no kernel drives it: %rpc_init --attach {group} "
    "drives it again, %rpc_shutdown --group {group} ends it"
)
KEPT_DEAD_TODO = (
    "a dead worker's namespace is lost and a kept group cannot restart it: go on with the "
    "others, or end the group (%rpc_shutdown --group {group}) and start a new one"
)
INPUT_NOBODY = "Input was asked for on {worker}, but nobody can answer: {why}"
INPUT_NO_CELL = (
    "this code runs outside any cell or call of the notebook (a thread an earlier cell "
    "left running); read the value in the cell and send it with %%remote --push"
)
INPUT_BACKGROUND = (
    "the cell runs in the background (%%remote --bg), which cannot ask the notebook; run "
    "it in the foreground, or set the value first (%%remote --push NAME)"
)
INPUT_NO_STDIN = (
    "this notebook's front end takes no input (a headless run such as nbconvert or "
    "nbclient without stdin); set the value in code or with %%remote --push NAME"
)
INPUT_NOT_HERE = (
    "the code was started by {caller}, which has no notebook to ask; call it from a "
    "notebook cell (rpc_sync or %%remote) to answer there"
)
INPUT_INTERRUPTED = "the notebook's cell was interrupted while it asked"
INPUT_GIVEN_UP = "the notebook no longer waits for this cell (it was interrupted or timed out)"
DEBUG_OTHERS = (
    "rpcnb: debugging {worker}; {others} failed too (%debug {first} debugs that one)."
)
NOTHING_TO_DEBUG = (
    "{worker} kept no failed {what} to debug: %debug opens pdb on a worker's last failure "
    "after a remote cell (or a function called there with rpc_sync) raised."
)
PDB_QUIT = "the debugger was quit (q) on {worker}; the cell stopped there, its namespace is kept"
NEVER_RAN = (
    "rpcnb: the cell never ran on {workers}: it was interrupted while it waited behind an "
    "earlier cell there, and dropped from the queue."
)
STILL_RUNS = (
    "The cell on {workers} went on after the interrupt (the code caught KeyboardInterrupt, "
    "or is in a C call that does not check for it): it is still running there, and cells "
    "sent to {them} wait behind it. Interrupt again, wait, or %rpc_restart {first} to end "
    "it (that worker's namespace is lost)."
)
BUSY_WITH = "{cell} (sent by {caller}, running for {seconds:.0f} s)"
WAITS_BEHIND = (
    "rpcnb: {worker} is still busy with {what}: this cell waits behind it. Interrupt the "
    "kernel to drop this cell from the queue, or %rpc_restart {worker} to end what runs "
    "(its namespace is lost); %rpc_stacks {worker} shows where it is."
)
QUEUED_BEHIND = (
    "rpcnb: this cell waits until the background cells running on {workers} end "
    "(%rpc_jobs lists them; .cancel() on a handle stops one)."
)
BG_NOT_READY = (
    "Background cell [{id}] has not ended after {timeout} s; .wait() or .result() without "
    "a timeout waits until it does, .cancel() stops it."
)
CANCELLED = "The background cell was cancelled; the worker stopped it."
CANCELLED_RUNNING = (
    "The background cell was cancelled, but {name} did not stop it and is still running it; "
    "%rpc_restart {name} replaces the worker (its namespace is lost)."
)
CHANGE_NOT_LEADER = (
    "Only the group's first kernel ({leader}) starts and restarts workers: run this there."
)
RESTART_SELF = "{name!r} is this kernel: restart the kernel itself, then %rpc_init again."
RESTART_NOT_OURS = (
    "{name!r} is a kernel that joined the group, not a worker rpcnb started: restart that "
    "kernel and run its %rpc_init --join line again."
)
RESTARTED = (
    "rpcnb: {name} was {was} (pid {old}); a fresh process (pid {new}) now runs under the "
    "same name, GPUs and device map. Its namespace starts empty: run the cells that set it "
    "up again."
)
RREFS_LOST = (
    "The RRefs {name} owned are lost; in this notebook: {names}."
)
ADD_COUNT = "--add takes how many workers to start (1 or more), not {n!r}."
ADD_WITH_DEVICE_MAPS = (
    "This group has device maps, which torch fixes when each member starts: the members "
    "already running could not send CUDA tensors to an added worker. Start the group again "
    "with the workers you need (%rpc_shutdown, then %rpc_init --workers N)."
)
ADDED = "rpcnb: added {n} worker(s): {names}."
LAUNCHER_FAILED = (
    "Worker {name!r} could not be started: {why}\nFix what it says (torch must import in a "
    "fresh Python of this kernel's environment), then run %rpc_init again."
)
START_FAILED = "Worker {name!r} failed to start ({how}). Its log ends with:\n{log}"
START_TIMEOUT = (
    "Worker {name!r} did not join within {timeout:g} s; it was stopped. Its log ends with:\n{log}"
)
RANK_FIXED = (
    "This kernel was rank {rank} in an earlier group, and torch's distributed autograd "
    "cannot take another rank in the same process; that rank is taken in this group: "
    "restart the kernel to join it."
)
IFACE_FIXED = (
    "TensorPipe in this process listens on {fixed!r} until the process exits (torch reads "
    "TP_SOCKET_IFNAME once per process), so it cannot start a group on {wanted!r}: "
    "restart the kernel first."
)
NOT_SENDABLE = (
    "A {type} cannot be sent to another process ({reason}): return something that pickles, "
    "or keep it where it is with rpc.remote and pass the RRef."
)
PUSH_NOT_PICKLABLE = (
    "--push: {name!r} (a {type}) cannot be sent to another process ({reason}): push what it "
    "holds instead, or create it on the worker."
)
NOT_PICKLABLE = (
    "The value of the last expression on {name!r} ({type}) cannot be sent back: {reason}. "
    "Leave out --fetch to keep it remote as an RRef."
)
INTERFACE_NEEDS_FLAG = (
    "--interface {iface} is not loopback: anyone who reaches it can run code in this group "
    "(TensorPipe does not authenticate); add --allow-remote to accept that."
)

# The headless worker (python -m rpcnb.worker --join ...)
TOKEN_ON_COMMAND_LINE = (
    "The token must not be on the command line (ps shows it to every user of this machine): "
    "use --token-file PATH (mode 0600: the token, or the group's connection.json) or "
    "--token - with the token on stdin."
)
TOKEN_NEEDED = (
    "Joining {addr} needs the group's token: --token-file PATH (mode 0600) or --token - "
    "with the token on stdin."
)
TOKEN_STDIN_EMPTY = "--token -: stdin gave no token; pipe it in, e.g. --token - < token-file."
TOKEN_FILE_UNREADABLE = "Cannot read the token from {path!r}: {reason}."
TOKEN_FILE_OPEN = (
    "The token file {path!r} may be read by others (mode {mode}) or is not yours: "
    "chmod 600 it (and start a new group if others could read it)."
)
HEADLESS_NO_NAME = (
    "Give this worker a --name: none of {variables} is set, so there is no launcher rank "
    "to name it from."
)
HEADLESS_LEADER_UNREACHABLE = (
    "rpcnb.worker: {leader}, the group's first kernel, is unreachable (its host answers "
    "nothing, not even at the network level); this worker stays in the group and waits up "
    "to {seconds:g} s for the network to come back."
)
HEADLESS_LEADER_GONE = (
    "rpcnb.worker: {leader}, the group's first kernel, has not answered for {seconds:g} s; "
    "this worker leaves the group and exits."
)

# ipyparallel engines as members (rpcnb.integrations.ipyparallel)
NEEDS_IPYPARALLEL = (
    "Engines as members need ipyparallel: pip install 'rpcnb[cluster]' (or ipyparallel), "
    "then restart the kernel."
)
BAD_ENGINES = "--engines must be a whole number of engines, 1 or more, not {engines!r}."
BAD_LAUNCHER = "--launcher {launcher!r} is not one of ipyparallel's launchers: choose from {known}."
BAD_CLUSTER_ARGS = (
    "--cluster-args: {item!r} is not an ipyparallel setting ({reason}): write key=value "
    "items, e.g. profile_dir=/tmp/p 'MPILauncher.mpi_args=[\"--oversubscribe\"]'."
)
BAD_ATTACH = (
    "rpcnb.attach takes an ipyparallel Cluster, a Client, or a profile name or cluster id, "
    "not a {what}."
)
ATTACH_NOT_FOUND = (
    "No running ipyparallel cluster {where!r}: give a cluster id from `ipcluster list`, "
    "PROFILE:CLUSTER_ID, a profile name or a profile directory, and check the cluster runs."
)
ADOPTED_RUNNING = ("[{id}] on {worker} still runs `{cell}` (started by {origin}, "
                   "{seconds:.0f} s ago): what it prints from now on shows below")
ADOPTED_ENDED = ("[{id}] on {worker} ran `{cell}` (started by {origin}) and ended "
                 "{ago:.0f} s ago while no kernel was attached: {status}")
ADOPTED_HOW = ("%rpc_jobs ID shows what a cell printed while no kernel was attached and "
               "its result; rpcnb.jobs() gives their handles (.result(), .output()).")
BG_OUTPUT_HERE = ("[{id}] started in this kernel: its output is in the cell that started "
                  "it.")
BG_KEPT_HEADER = "What it printed on {workers} while no kernel was attached ({origin} had gone):"
BG_RESULT = "[{id}] ended: {value}"
BG_FAILED = "[{id}] failed: {error}"
NO_SUCH_JOB = "No background cell [{id}] in this kernel (its cells: {known}); %rpc_jobs --all lists them."
ADOPTED_NOTE = ("{ids}: started by {origins}, which went away; taken over when this kernel "
                "attached. %rpc_jobs ID shows what one printed meanwhile.")
BG_KEPT_NOTHING = "[{id}] printed nothing on {workers} while no kernel was attached."
NO_ORPHAN = ("{worker} keeps no cell {call_id} for this kernel: it was adopted by another "
             "kernel, or ended and was dropped (a member keeps the last 8)")
CLUSTER_FAILED = "ipyparallel could not start the engines with the {launcher} launcher: {reason}"
NO_ENGINES = "The ipyparallel cluster has no engines to make members: start some first."
ENGINES_ELSEWHERE = (
    "Engines run on other hosts ({hosts}), which cannot reach a group that meets on this "
    "host only: add --port PORT --host ADDRESS --allow-remote with an address of this "
    "host on the network they share (see " + docs.ref("clusters") + ")."
)
ENGINE_FAILED = "Engine {engine} could not join the group as {name}: {reason}"
ENGINE_TIMEOUT = "Engine {engine} did not join the group as {name} within {timeout:g} s."
ENGINE_SILENT = (
    "Engine {engine} did not answer within {timeout:g} s: it is registered but runs no task "
    "(busy, or stuck in an earlier one); see its log, or restart the cluster."
)
ENGINES_AND_WORKERS = (
    "--engines and --workers do not go together: the engines are the workers "
    "(worker1..workerN)."
)
NO_CLUSTER = "This group has no ipyparallel engines: start it with %rpc_init --engines N or --attach."
LAUNCHER_NEEDS_ENGINES = "--launcher and --cluster-args go with --engines N."
ZERO_COPY_UNREACHABLE = (
    "A shared-memory tensor sent by handle ({where}) cannot be mapped here "
    "({reason}): send a copy instead with rpcnb.run(..., zero_copy=False), %%remote --copy "
    "or `with rpcnb.copying():`, or start the group with %rpc_init --no-zero-copy."
)


def raise_from(err: BaseException, exc: BaseException) -> NoReturn:
    """``raise err from exc`` inside ``except ... as exc``, where ``err`` may be ``exc``
    itself (then it is raised as it was). Pass ``err`` as an expression: a local holding
    it would make a cycle with its traceback (which holds the frame), and whatever the
    frames hold (a message's tensors) would wait for the cycle collector instead of going
    when the caller drops the error; ``raise exc from exc`` makes one of its own."""
    try:
        if err is exc:
            raise err
        raise err from exc
    finally:
        del err, exc


class RpcnbError(RuntimeError):
    """A problem rpcnb can name: bad input, a missing group, a dead worker.

    The base of rpcnb's own errors (``WorkerDiedError``, ``RemoteError``); its message is
    one sentence that says what to do, and IPython shows that sentence without the local
    traceback. The magics show a plain ``RpcnbError`` as a ``UsageError``.
    """

    results: dict[str, Any] | None = None  # a cell sent to several: the others' results

    def _render_traceback_(self) -> list[str]:
        # IPython shows this instead of a deep local stack: the message says it all.
        return [f"{type(self).__name__}: {self}", *self._others()]

    def _others(self) -> list[str]:
        """What the members that did finish returned (a cell sent to several)."""
        if not self.results:
            return []
        import reprlib

        shown = reprlib.Repr()  # keyword arguments only from Python 3.12
        shown.maxlevel, shown.maxdict, shown.maxstring, shown.maxother = 2, 8, 60, 60
        return ["", f"{', '.join(self.results)} finished; their results are in this error's "
                f".results (sys.last_value.results in IPython): {shown.repr(self.results)}"]


class WorkerDiedError(RpcnbError):
    """The worker a call went to has died (or left) before answering.

    The message says how it died (for a process this kernel started, with the end of its
    log); the rest of the group keeps working.

    Attributes:
        worker: the name of the worker that died or left.
        results: for a cell sent to several workers, what those that finished returned
            (by name); None otherwise.
    """

    def __init__(self, message: str, worker: str) -> None:
        super().__init__(message)
        self.worker = worker


class WorkerUnreachableError(RpcnbError):
    """The worker a call went to cannot be reached: its host has answered nothing, not
    even at the network level, for a few seconds (a partition, or a lost host).

    It is not declared dead: when its host answers again it is back, with its namespace.

    Attributes:
        worker: the name of the unreachable worker.
        results: for a cell sent to several workers, what those that finished returned
            (by name); None otherwise.
    """

    def __init__(self, message: str, worker: str) -> None:
        super().__init__(message)
        self.worker = worker


class RemoteError(RpcnbError):
    """An exception raised by code running on a worker.

    IPython shows the remote traceback instead of the local one (``_render_traceback_``).
    The worker lives on, its namespace as the cell left it.

    Attributes:
        worker: the name of the worker the code raised on.
        ename: the remote exception's type name, e.g. ``"ZeroDivisionError"``.
        evalue: the remote exception's message.
        traceback: the remote traceback text, with the cell's own line numbers
            (``<worker1 cell 3>``).
        results: for a cell sent to several workers, what those that finished returned
            (by name); None otherwise.
    """

    def __init__(self, worker: str, ename: str, evalue: str, traceback: str) -> None:
        super().__init__(f"{ename} on {worker}: {evalue}")
        self.worker = worker
        self.ename = ename
        self.evalue = evalue
        self.traceback = traceback

    def _render_traceback_(self) -> list[str]:
        head = f"RemoteError: {self.ename} on {self.worker}"
        body = self.traceback.rstrip("\n").splitlines() or [f"{self.ename}: {self.evalue}"]
        return [head, *body, *self._others()]


SUMMARY_CHARS = 200  # the first line of several workers' errors, at most about
SHOWN_KINDS = 4  # different errors shown with their traceback; the rest are named


class CompositeRemoteError(RemoteError):
    """Several workers raised; ``errors`` maps each worker's name to its RemoteError.

    Raised by a cell sent to several workers (``%%remote w1,w2``, ``--all``) when more than
    one of them raised. Workers that raised the same error (type, message and traceback,
    apart from the worker's own name) show as one traceback labelled with their set
    (``worker1-32``); each different error shows once; ``%debug WORKER`` opens any one
    worker's frames.

    Attributes:
        errors: each worker's name mapped to its ``RemoteError``, every one kept.
        kinds: the workers that raised each different error, in the order first raised.
        worker: the first of those workers (``ename``, ``evalue`` and ``traceback`` are
            its error's, as a single ``RemoteError`` has them).
        results: for a cell sent to several workers, what those that finished returned
            (by name); None otherwise.
    """

    def __init__(self, errors: dict[str, RemoteError]) -> None:
        first = next(iter(errors.values()))
        super().__init__(first.worker, first.ename, first.evalue, first.traceback)
        self.errors = errors
        kinds: dict[tuple[str, str, str], list[str]] = {}
        for name, err in errors.items():
            kinds.setdefault(_alike(err), []).append(name)
        self.kinds = list(kinds.values())
        self.args = (self.summary(),)

    def summary(self) -> str:
        """One line, about ``SUMMARY_CHARS`` at most: ``32 workers raised
        ZeroDivisionError: division by zero (worker1-32)``."""
        n = len(self.errors)
        if len(self.kinds) == 1:
            err = self.errors[self.kinds[0][0]]
            where = f" ({text.worker_set(self.kinds[0])})"
            said = f"{n} workers raised {err.ename}: {_first_line(err.evalue)}"
            return _cut(said, SUMMARY_CHARS - len(where)) + where
        parts = [f"{self.errors[k[0]].ename} ({text.worker_set(k)})" for k in self.kinds]
        return _cut(f"{n} workers raised {len(self.kinds)} different errors: " + "; ".join(parts),
                    SUMMARY_CHARS)

    def _render_traceback_(self) -> list[str]:
        lines: list[str] = [f"CompositeRemoteError: {self.args[0]}"]
        for kind in self.kinds[:SHOWN_KINDS]:
            err = self.errors[kind[0]]
            lines += ["", f"RemoteError: {err.ename} on {text.worker_set(kind)}",
                      *(err.traceback.rstrip("\n").splitlines() or [f"{err.ename}: {err.evalue}"])]
        rest = self.kinds[SHOWN_KINDS:]
        if rest:
            lines += ["", f"... and {len(rest)} more different errors: " + "; ".join(
                f"{self.errors[k[0]].ename} ({text.worker_set(k)})" for k in rest)]
        if len(self.kinds) < len(self.errors) or rest:
            lines += ["", "Each worker's own error is in this error's .errors[NAME] "
                      "(sys.last_value.errors in IPython); %debug NAME opens its frames."]
        return [*lines, *self._others()]


def _alike(err: RemoteError) -> tuple[str, str, str]:
    """An error apart from the worker it happened on: its type, message and traceback, with
    the worker's name and its cells' numbers (``<worker7 cell 3>``) made alike."""
    name = re.escape(err.worker)

    def plain(said: str) -> str:
        said = re.sub(rf"<{name} cell \d+>", "<cell>", said)
        return re.sub(rf"\b{name}\b", "<worker>", said)

    return err.ename, plain(err.evalue), plain(err.traceback)


def _first_line(said: str) -> str:
    return (said.strip().splitlines() or [""])[0]


def _cut(said: str, limit: int) -> str:
    return said if len(said) <= limit else said[:max(0, limit - 3)].rstrip() + "..."

UCX_MISSING = (
    "--ucx (RPCNB_UCX=1) needs the ucxx package, which is not installed here: "
    "pip install 'rpcnb[{extra}]' (the one for this torch's CUDA; in every environment the "
    "group's members run in), or leave out --ucx."
)
UCX_BROKEN = (
    "--ucx: ucxx is installed but does not load here ({reason}): reinstall it with "
    "pip install --force-reinstall 'rpcnb[{extra}]', or leave out --ucx."
)
UCX_NOT_ON = (
    "{sender} sent a tensor over UCX, but this member ({name}) has no UCX path: join with "
    "--ucx (or RPCNB_UCX=1), as the group's first kernel did."
)
UCX_PEER_LOST = (
    "A tensor from {peer!r} over UCX did not arrive: {reason}. If {peer} died, %rpc_workers "
    "says so and %rpc_restart {peer} replaces it."
)
UCX_GONE = (
    "{peer!r} asked for a tensor this member no longer holds for it (it waited longer than "
    "the group's RPC timeout, or the group restarted): send it again."
)

COLLECTIVES_NOT_HERE = (
    "--collectives is for the group's first kernel and the workers it starts "
    "(%rpc_init --workers N --collectives gloo): joined kernels, headless workers and "
    "ipyparallel engines cannot take part in its process group."
)
COLLECTIVES_NEED_WORKERS = "--collectives needs workers to form a process group: add --workers N."
COLLECTIVE_LEFT_WAITING = (
    "rpcnb: {workers} still {verb} inside a collective that not every rank joined: torch "
    "cannot stop it before its time limit ({timeout:g} s, --collective-timeout). The next "
    "remote cell waits until it ends, then forms the workers' process group again."
)
COLLECTIVE_TIMEOUT = (
    "A collective waits for every rank of the workers' process group: this cell ran on "
    "{ran}, and {missing} never came. Run collectives on every worker (%%remote --all)."
)
FENCE_SLOW = (
    "some members of the group did not say within 5 s that they let this host in (a member "
    "that died without leaving never answers). Calls between this kernel and such a member "
    "may not connect: %rpc_workers shows who is there; docs/security.md, 'Strangers' bytes'.")
JOIN_WHILE_UNREACHABLE = (
    "{names} cannot be reached now (unreachable since {since}). torch admits a new member "
    "only once every member has agreed, so a join now would wait for torch's timeout and "
    "fail: try again when {them} answer again (%rpc_workers shows it; they come back on "
    "their own when the network does), or start a new group.")
NOT_FENCED = (
    "this member's TensorPipe listeners are not IPv4 ones, so they are not fenced: bytes "
    "from a stranger that reaches them can end this process. Use an IPv4 address for --host "
    "(docs/security.md, 'Strangers' bytes').")

# %rpc_stacks (rpcnb.observe.stacks): a member that shows no stack, and why
STACKS_DEAD = "{name}: dead ({how}); it has no stack to show."
STACKS_UNREACHABLE = "{name}: unreachable since {since} (its host answers nothing): not asked."
STACKS_SILENT = (
    "{name}: did not answer within {seconds}: a C call there may hold the GIL, or its host is "
    "overloaded. %rpc_stacks {name} --timeout 10 waits longer; %rpc_restart {name} replaces it "
    "(its namespace is lost)."
)
STACKS_IDLE = "runs no cell now."
STACKS_BAD_TIMEOUT = "--timeout must be a positive number of seconds, not {timeout}."

# %rpc_who (rpcnb.observe.names): a member whose variables are not shown, and why
WHO_NONE = "no variables (IPython's own names, modules and names that start with _ are left out)."
WHO_DEAD = "{name}: dead ({how}); its namespace is lost."
WHO_UNREACHABLE = "{name}: unreachable (its host answers nothing): not asked."
WHO_SILENT = (
    "{name}: did not answer within {seconds}: a C call there may hold the GIL, or its host is "
    "overloaded. %rpc_stacks {name} shows where it is."
)
# Shift-Tab in a %%remote cell (rpcnb.frontend.completion): the worker did not answer
INSPECT_SILENT = (
    "rpcnb: {name} did not answer within {seconds:g} s (a cell there may hold the GIL), so "
    "there is nothing to show of its {what!r}; the notebook's own {what!r} would be another "
    "object. Try again when {name} is idle (%rpc_stacks {name} shows where it is)."
)
