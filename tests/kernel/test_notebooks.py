"""Every notebook in notebooks/ runs top to bottom in a fresh kernel (nbclient), shows the
result it teaches (parsed from what it printed, not just "it ran") and its figures, and
leaves no process behind: the kernel's descendants are tracked by pid while it runs, must be
gone after the last cell (``%rpc_shutdown``) and after the kernel, and are killed if not.
Its executed copy in notebooks/executed/ (``make tutorials``, committed) has the same code,
no error and the same figures.

Which kernelspec a notebook runs on. The isolated ``rpcnb`` kernelspec (kernelspec/,
rpcnb/sandbox/provisioner.py, docs/security.md) changes one thing against the plain
``python3`` one: the network the kernel and every worker it starts are in (the user's
private network namespace, with nothing but ``lo``) and how Jupyter reaches the kernel (ipc
sockets instead of TCP ports). Python, torch, files, /dev/shm and CUDA IPC are the
machine's on both. So a notebook runs on both kernelspecs when what it shows depends on the
network: starting a group and leaving it (the quickstart: the flow every notebook begins
and ends with), what members listen on, the ports and addresses they meet at, joining, the
transports and channels between them, or another rendezvous next to RPC (collectives).
Those are ``BOTH_KERNELS``, each with its reason. Every other notebook runs once, on the
kernelspec its own metadata names (what a user who opens it gets). A new notebook follows
the same rule: add it to ``BOTH_KERNELS`` when its subject is one of those."""

from __future__ import annotations

import functools
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nbformat
import pytest
from conftest import Seen, children_of, kill_all
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK_DIR = ROOT / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
EXECUTED_DIR = NOTEBOOK_DIR / "executed"
EXECUTED_LIMIT = 512 * 1024  # bytes: an executed copy stays small enough to browse and diff
# the figures (image/png outputs) each notebook shows; none where it is not listed
FIGURES = {
    "03_parameter_server": 1,  # loss per epoch of each trainer
    "04_a3c": 1,  # reward per episode
    "05_federated_averaging": 1,  # FedAvg per round against its baselines
    "06_pipeline": 1,  # the two schedules' timelines
    "07_channels_and_device_maps": 1,  # probe round trip and bandwidth by size and path
    "08_ddp_parameter_server": 1,  # loss per epoch of each DDP trainer
}
# the notebooks that run on both kernelspecs (the rule: this module's docstring), and why
BOTH_KERNELS = {
    "01_quickstart": "starts a group, runs remote cells, leaves: what every notebook does",
    "07_channels_and_device_maps": "transports, channels and probes between the members",
    "08_ddp_parameter_server": "--collectives gloo: a process group that listens beside RPC",
}
OTHER_KERNEL = {"python3": "rpcnb", "rpcnb": "python3"}
CELL_TIMEOUT = 180  # seconds per cell
NOTEBOOK_LIMIT = 180.0  # seconds for a whole notebook, kernel start included
GRACE = 5.0  # seconds processes get to exit after %rpc_shutdown / the kernel's shutdown
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


@dataclass
class Run:
    """One executed notebook: its cells with outputs, and what it left running."""

    path: Path
    nb: Any = None
    seconds: float = 0.0
    error: str = ""
    kernel_pid: int | None = None
    kernel: Seen = field(default_factory=Seen)  # the kernel process
    seen: Seen = field(default_factory=Seen)  # every descendant of the kernel seen
    left_after_last_cell: list[int] = field(default_factory=list)
    left_after_kernel: list[int] = field(default_factory=list)

    @property
    def outputs(self) -> list[dict[str, Any]]:
        return [o for c in self.nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]

    @property
    def text(self) -> str:
        """Everything the notebook printed or showed as text, in order."""
        parts = []
        for o in self.outputs:
            if o.get("output_type") == "stream":
                parts.append(o.get("text", ""))
            elif o.get("output_type") in ("execute_result", "display_data"):
                parts.append(o.get("data", {}).get("text/plain", "") + "\n")
            elif o.get("output_type") == "error":
                parts.append(_ANSI.sub("", "\n".join(o.get("traceback", []))) + "\n")
        return "".join(parts)

    def images(self) -> int:
        return sum("image/png" in o.get("data", {}) for o in self.outputs)

    def number(self, pattern: str) -> float:
        """The number captured by ``pattern`` in the notebook's text (its last match)."""
        found = re.findall(pattern, self.text)
        assert found, f"{self.path.name} printed nothing matching {pattern!r}:\n{self.text}"
        return float(found[-1])


def _wait_gone(procs: Seen, grace: float) -> list[int]:
    deadline = time.monotonic() + grace
    left = procs.alive()
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = procs.alive()
    return left


def _warm_launcher(pid: int) -> bool:
    """Whether ``pid`` is a kernel's warm launcher (rpcnb.procs.forkserver), not a worker it forked
    (those share its command line and take the name ``rpcnb workerN``)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        name = Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return False
    return b"rpcnb.procs.forkserver" in cmdline and not name.startswith("rpcnb ")


def kernelspecs(path: Path) -> list[str]:
    """The kernelspecs ``path`` runs on: the one its metadata names, and the other one too
    when it is in ``BOTH_KERNELS``."""
    own = nbformat.read(path, as_version=4).metadata.kernelspec.name
    return [own, OTHER_KERNEL[own]] if path.stem in BOTH_KERNELS else [own]


# On a GPU machine notebook 02's run is read twice (by the test of every notebook and by
# the gpu-marked test at the end): both go to one xdist worker, where it runs once.
CUDA_RUN = pytest.mark.xdist_group("02_cuda_rpc")
CASES = [pytest.param(path, kernel, id=f"{path.stem}-{kernel}",
                      marks=[CUDA_RUN] if path.stem == "02_cuda_rpc" else [])
         for path in NOTEBOOKS for kernel in kernelspecs(path)]


@functools.cache
def run_notebook(path: Path, kernel: str = "python3") -> Run:
    """Execute ``path`` once per test session and kernel (several tests read one run)."""
    run = Run(path)
    run.nb = nbformat.read(path, as_version=4)
    client = NotebookClient(run.nb, timeout=CELL_TIMEOUT, kernel_name=kernel,
                            resources={"metadata": {"path": str(path.parent)}})
    stop = threading.Event()

    def watch() -> None:  # workers may start and exit between two cells
        while not stop.wait(0.2):
            if run.kernel_pid is not None:
                run.seen.update(children_of(run.kernel_pid))

    def on_start(**_: Any) -> None:
        run.kernel_pid = client.km.provisioner.pid  # type: ignore[union-attr]
        run.kernel.add(run.kernel_pid)

    last_code = max(i for i, c in enumerate(run.nb.cells) if c.cell_type == "code")

    def on_cell(cell_index: int, **_: Any) -> None:
        if run.kernel_pid is None:
            return
        run.seen.update(children_of(run.kernel_pid))
        if cell_index == last_code:  # %rpc_shutdown: the kernel lives, its workers must not
            # (its warm launcher stays for the next group, by design; it ends with the
            # kernel, which left_after_kernel checks)
            workers = run.seen.only(lambda p: not _warm_launcher(p))
            run.left_after_last_cell = _wait_gone(workers, GRACE)

    client.on_notebook_start = on_start
    client.on_cell_executed = on_cell
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    started = time.monotonic()
    try:
        client.execute()  # starts a fresh kernel and shuts it down afterwards
    except Exception as exc:  # a cell raised, timed out, or the kernel died
        run.error = f"{type(exc).__name__}: {exc}"
    finally:
        run.seconds = time.monotonic() - started
        stop.set()
        watcher.join()
        everything = run.seen.copy()
        everything |= run.kernel
        if run.kernel_pid is not None and run.kernel.alive():
            everything |= children_of(run.kernel_pid)
        run.left_after_kernel = _wait_gone(everything, GRACE)
        kill_all(run.left_after_kernel)
    print(f"{path.name}: {run.seconds:.1f} s, {len(run.seen)} child processes")
    return run


# -- the key result of each notebook -----------------------------------------------------


def check_quickstart(run: Run) -> None:
    text = run.text
    assert "RRef on worker1" in text
    assert "tensor([  2.,  20., 200.])" in text  # --push then --fetch
    assert "failed on: worker2" in text  # a remote error names its worker
    assert "did not finish within 1 s" in text  # --timeout interrupted the cell
    assert "rpcnb: left the group" in text


def check_cuda_rpc(run: Run) -> None:
    text = run.text
    gpus = int(run.number(r"CUDA devices on this machine: (\d+)"))
    assert "dict form:         {'worker1': {'cuda:0': 'cuda:1'}}" in text
    assert "DI-engine string:  1_0_1\n" in text
    assert "Python snippet:    options.set_device_map('worker1', {'cuda:0': 'cuda:1'})" in text
    if gpus == 0:
        assert "this machine has no CUDA devices" in text
        assert "with a GPU this notebook would also run comm_mode='cuda'" in text
    else:
        assert "the device map is valid on this machine" in text
        assert run.number(r"CUDA RPC speedup: ([\d.]+)x") > 1
    assert run.number(r"cpu RPC total execution time: ([\d.]+) s") > 0
    # distributed autograd left gradients on both shards
    for shard in ("worker0", "worker1"):
        norms = re.search(rf"{shard} shard: \{{'linear.weight': ([\d.]+), 'linear.bias': ([\d.]+)\}}",
                          text)
        assert norms and float(norms.group(1)) > 0 and float(norms.group(2)) > 0, text


def check_parameter_server(run: Run) -> None:
    assert run.number(r"test accuracy before training: ([\d.]+)") < 0.5
    for trainer in ("worker2", "worker3"):
        assert f"{trainer} loss per epoch:" in run.text
    assert run.number(r"(?m)^test accuracy: ([\d.]+)$") >= 0.9


def check_a3c(run: Run) -> None:
    first = run.number(r"mean reward, first 20 episodes: ([\d.]+)")
    last = run.number(r"mean reward, last 20 episodes: ([\d.]+)")
    best = run.number(r"best mean of 20 in a row in the second half: ([\d.]+)")
    # it learned: what the moving mean reached in the second half. The last 20 episodes
    # alone are too noisy a measure: 3.4-15x the first 20 in 82 runs here (real ones and a
    # simulation of the two actors' updates), but 1.7x once in CI (asynchronous RL may peak
    # and fall back before its end). The best window is biased upward: with no learning at
    # all it was 0.93-1.93x the first 20 (30 simulated runs), hence 2.5x
    assert best >= 2.5 * first, f"the reward did not rise enough: {first} -> best {best}"
    assert last > first, f"the reward fell back below its start: {first} -> {last}"
    assert run.number(r"(\d+) episodes in [\d.]+ s") == 300
    assert run.number(r"(\d+) lines of communication code") <= 12  # the paper's "about ten"


def check_federated_averaging(run: Run) -> None:
    rounds = [float(a) for a in re.findall(r"round +\d+: test accuracy ([\d.]+)", run.text)]
    assert len(rounds) == 40, run.text
    assert rounds[-1] > rounds[0] + 0.3  # it learned across rounds
    final = run.number(r"final test accuracy: ([\d.]+)")
    assert final == rounds[-1]
    assert final >= 0.85
    # the baselines: pooled data above FedAvg, each client alone far below it
    assert run.number(r"FedAvg, 40 rounds: +test accuracy ([\d.]+)") == final
    assert run.number(r"pooled data, 40 epochs: +test accuracy ([\d.]+)") >= 0.9
    alone = re.findall(r"(worker\d) alone \(digits \d-\d\): test accuracy ([\d.]+)", run.text)
    assert [name for name, _ in alone] == ["worker1", "worker2", "worker3"], run.text
    assert all(float(acc) <= 0.45 < final for _, acc in alone)  # at most 4 digits of 10


def check_pipeline(run: Run) -> None:
    text = run.text
    assert "pipelined == unsplit model (torch.allclose): True" in text
    assert "sequential == unsplit model (torch.allclose): True" in text
    assert run.number(r"sequential: (\d+) ms") > 0
    assert run.number(r"pipelined: +(\d+) ms") > 0
    assert run.number(r"speedup: +([\d.]+)x") > 0  # printed; not asserted: the machine is shared
    assert "{'worker1': 1, 'worker2': 1}" in text  # one thread per stage


_PROBE_ROW = re.compile(r"(?m)^ +(1 KB|64 KB|1 MB|16 MB) +([\d.]+) ms +[\d.]+ [KMG]B/s +(\S+)$")


def _cpu_channel_here() -> str:
    """TensorPipe's CPU channel between two processes of this user on this machine: cma
    unless yama or seccomp forbids it (then mpt_uv), by rpcnb's own model."""
    from rpcnb.observe import channels

    facts = channels.Facts.from_dict(channels.local_facts())
    return "cma" if channels.viable(facts)["cma"] is None else "mpt_uv"


def check_channels_and_device_maps(run: Run) -> None:
    text = run.text
    cpu = _cpu_channel_here()
    # the prediction: uv transport (rpcnb's default), then basic once restricted
    assert f"default group, worker0 -> worker1: transport uv, CPU channel {cpu}" in text
    assert re.search(rf"worker0 +worker1 +uv +cpu->cpu +{cpu} +{cpu}: ", text), text
    assert re.search(r"worker0 +worker1 +uv +cpu->cpu +basic +basic: the data rides the uv "
                     r"transport \(cma: not in worker1's --channels", text), text
    # list order is priority (the what-if, no group started)
    assert re.search(r"\{'channels': \['basic', 'mpt_uv'\]\} +-> uv / basic", text)
    assert re.search(r"\{'channels': \['mpt_uv', 'basic'\]\} +-> uv / mpt_uv", text)
    # the monitor saw worker1's calls to worker2, and stopped at %rpc_shutdown
    assert run.number(r"worker1->worker2 +uv / \S+ +calls +(\d+)") >= 20
    assert "monitor: stopped: the group was shut down" in text
    # three probe tables (default, --tensorpipe, --channels basic): figures for each size
    tables = text.split("probe from worker0\n")[1:]
    assert len(tables) == 3, text
    rows = [[(size, float(ms), path) for size, ms, path in _PROBE_ROW.findall(t)] for t in tables]
    sizes = ["1 KB", "64 KB", "1 MB", "16 MB"]
    assert [r[0] for r in rows[0]] == sizes * 2  # worker1 and worker2
    assert [r[2] for r in rows[0]] == [cpu, cpu, "rpcnb_shm", "rpcnb_shm"] * 2
    assert [(r[0], r[2]) for r in rows[1]] == [(s, cpu) for s in sizes]
    assert [(r[0], r[2]) for r in rows[2]] == [(s, "basic") for s in sizes]
    assert all(ms > 0 for table in rows for _, ms, _ in table)
    # device maps: the editor's forms, the code's forms, the validation messages
    assert "string  1_0_1,1_1_0\n" in text
    assert "dict form:         {'worker1': {'cuda:0': 'cuda:1', 'cuda:1': 'cuda:0'}}" in text
    assert "DI-engine string:  1_0_1,1_1_0\n" in text
    assert ("Python snippet:    options.set_device_map('worker1', "
            "{'cuda:0': 'cuda:1', 'cuda:1': 'cuda:0'})") in text
    assert "the plan: valid" in text
    assert ("duplicated target: duplicated target device: cuda:0 and cuda:1 map to the same "
            "device cuda:1 on worker1") in text
    assert ("missing device: worker1 has only 2 CUDA devices (cuda:0, cuda:1), so cuda:2 in "
            "the map for worker1 does not exist there") in text
    assert "apply: Not applied: fix the problems listed above first." in text
    assert "DI-engine string, with the group's ranks: 1_0_0,2_1_0" in text
    if run.number(r"CUDA devices on this machine: (\d+)") == 0:
        assert "here: The map for worker1 sends from cuda:0, but this machine has no CUDA" in text
        assert "problem: worker2 has no CUDA devices, so the map for worker2 cannot land on" in text


def check_ddp_parameter_server(run: Run) -> None:
    text = run.text
    # the workers' process group, and the trainers' subgroup that leaves the server out
    assert "the workers form a process group (gloo): worker1..worker3 are ranks 0..2" in text
    for name, rank, sub in (("worker1", 0, -1), ("worker2", 1, 0), ("worker3", 2, 1)):
        assert (f"'{name}': {{'rank': {rank}, 'world size': 3, "
                f"'rank among the trainers': {sub}}}") in text, text
    # the embedding table on the server; each trainer optimizes it and its own dense layer
    assert "RemoteModule on worker1, device cpu" in text
    assert "RRef on worker1: torch.nn.modules.sparse.EmbeddingBag" in text
    assert "[worker2] trainer 0: 3 parameters, owned by ['worker1', 'worker2']" in text
    assert "[worker3] trainer 1: 3 parameters, owned by ['worker1', 'worker3']" in text
    # both trained (their tqdm bars ran to the end), and both losses fell
    for trainer in ("worker2", "worker3"):
        assert f"[{trainer}] epochs: 100%" in text, text
        assert f"[{trainer}] 300 steps in " in text, text
        first = run.number(rf"{trainer} loss: first epoch ([\d.]+)")
        last = run.number(rf"{trainer} loss: first epoch [\d.]+, last epoch ([\d.]+)")
        assert last < first / 2, f"{trainer}'s loss did not fall enough: {first} -> {last}"
    # one model in two places: DDP kept the dense replicas equal, the table is shared
    accuracy = {t: run.number(rf"{t}: test accuracy ([\d.]+)") for t in ("worker2", "worker3")}
    assert accuracy["worker2"] == accuracy["worker3"] >= 0.7, accuracy
    assert "dense weights equal on both trainers: True" in text
    assert "embedding table, fetched from worker1: (100, 16)" in text
    # the profiled step: each trainer's top operators, with the distributed backward
    for trainer in ("worker2", "worker3"):
        table = text.split(f"[{trainer}] top operators (CPU self time):\n", 1)
        assert len(table) == 2, text
        assert "torch::distributed::autograd::backward" in table[1].split("Self CPU time total")[0]
        assert re.search(rf"\[{trainer}\] trace: \S+/{trainer}\.json", text), text
    assert "all workers on one timeline: " in text
    assert "rpcnb: left the group" in text


CHECKS: dict[str, Callable[[Run], None]] = {
    "01_quickstart": check_quickstart,
    "02_cuda_rpc": check_cuda_rpc,
    "03_parameter_server": check_parameter_server,
    "04_a3c": check_a3c,
    "05_federated_averaging": check_federated_averaging,
    "06_pipeline": check_pipeline,
    "07_channels_and_device_maps": check_channels_and_device_maps,
    "08_ddp_parameter_server": check_ddp_parameter_server,
}


# -- tests ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("path", "kernel"), CASES)
def test_notebook_runs_and_shows_its_result(path: Path, kernel: str) -> None:
    # on its own kernelspec, and unchanged on the other one where that one's network could
    # change what it shows (BOTH_KERNELS; docs/security.md)
    run = run_notebook(path, kernel)
    try:
        assert not run.error, f"{path.name} failed:\n{run.error}"
        assert not run.left_after_last_cell, (
            f"{path.name}: processes still running after its last cell: {run.left_after_last_cell}")
        assert not run.left_after_kernel, (
            f"{path.name}: processes outlived the kernel (killed): {run.left_after_kernel}")
        assert run.seen, f"{path.name} started no worker process"
        assert run.seconds < NOTEBOOK_LIMIT, f"{path.name} took {run.seconds:.0f} s"
        check = CHECKS.get(path.stem)
        if check is not None:
            check(run)
        assert run.images() == FIGURES.get(path.stem, 0), f"{path.name}: figures shown"
    except AssertionError:
        print(run.text)
        raise


def test_every_checked_notebook_exists() -> None:
    assert set(CHECKS) <= {p.stem for p in NOTEBOOKS}
    assert set(FIGURES) <= {p.stem for p in NOTEBOOKS}
    assert set(BOTH_KERNELS) <= {p.stem for p in NOTEBOOKS}
    assert all(kernelspecs(p)[0] in OTHER_KERNEL for p in NOTEBOOKS), "a notebook's own kernelspec"


def _code(nb: Any) -> list[str]:
    return [c.source for c in nb.cells if c.cell_type == "code"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_executed_copy_is_current(path: Path) -> None:
    """The committed copy with outputs (what GitHub and the docs site show) is the
    notebook's own code, run to the end without an error, with its figures."""
    executed = EXECUTED_DIR / path.name
    assert executed.exists(), f"no {executed.relative_to(ROOT)}: run make tutorials"
    nb = nbformat.read(executed, as_version=4)
    nbformat.validate(nb)
    assert _code(nb) == _code(nbformat.read(path, as_version=4)), (
        f"{executed.relative_to(ROOT)} is stale (its code differs from {path.name}): "
        "run make tutorials and commit notebooks/executed/")
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.execution_count for c in code), f"{executed.name} was not run to the end"
    outputs = [o for c in code for o in c.outputs]
    errors = [o for o in outputs if o.output_type == "error"]
    assert not errors, f"{executed.name} shows an error: {errors[0].get('evalue')}"
    images = sum("image/png" in o.get("data", {}) for o in outputs)
    assert images == FIGURES.get(path.stem, 0), f"{executed.name}: {images} figures"
    assert executed.stat().st_size < EXECUTED_LIMIT, f"{executed.name} is too large"


def test_no_executed_copy_without_its_notebook() -> None:
    orphans = {p.name for p in EXECUTED_DIR.glob("*.ipynb")} - {p.name for p in NOTEBOOKS}
    assert not orphans, f"notebooks/executed/ has copies of no notebook: {sorted(orphans)}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_is_stored_without_outputs(path: Path) -> None:
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert not cell.outputs and cell.execution_count is None, (
                f"{path.name} is stored with outputs: clear them before committing")


def _gpus() -> int:
    import torch

    return torch.cuda.device_count()


@pytest.mark.gpu
@CUDA_RUN
@pytest.mark.skipif(_gpus() < 1, reason="needs a CUDA device: only then does 02_cuda_rpc "
                    "compare comm_mode='cpu' with 'cuda' (map {0: 0} on one GPU, {0: 1} on two)")
def test_cuda_rpc_notebook_compares_cpu_and_cuda_modes() -> None:
    path = NOTEBOOK_DIR / "02_cuda_rpc.ipynb"
    run = run_notebook(path, kernelspecs(path)[0])  # the run the test above read, if it ran here
    assert not run.error, run.error
    expected = "map {0: 1}" if _gpus() >= 2 else "map {0: 0} (CUDA IPC)"
    assert expected in run.text
    cpu = run.number(r"cpu RPC total execution time: ([\d.]+) s")
    cuda = run.number(r"cuda RPC total execution time: ([\d.]+) s")
    assert run.number(r"CUDA RPC speedup: ([\d.]+)x") == pytest.approx(cpu / cuda, rel=0.1)
