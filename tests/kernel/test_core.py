"""The core surface in real kernels: %rpc_init, %%remote, %rpc_workers, %rpc_shutdown.

Each test drives a real IPython kernel through jupyter_client, as a notebook would; the
kernel starts real worker processes that talk torch RPC over loopback.
"""

from __future__ import annotations

import ast
import os
import re
import signal
import time
from pathlib import Path

import pytest
from conftest import children_of, listening_addresses, pid_alive, run_watched, worker_pids

# The PyTorch CUDA RPC recipe (shared/seeds/000_00ff677fa0ebadd3.txt), kept with the tests
# so they do not depend on where shared/ lies.
SEED = Path(__file__).parents[1] / "data" / "cuda_rpc_recipe.txt"


def torch_gpus() -> int:
    """The CUDA devices of this machine (the tests' kernels see the same)."""
    import torch

    return torch.cuda.device_count()


def test_load_ext_is_light_and_quiet(kernel):
    out = kernel.execute(
        "%load_ext rpcnb\nimport sys, os\n"
        "print('torch' in sys.modules, os.environ.get('TORCH_CPP_LOG_LEVEL'))"
    )
    assert out.stdout.split() == ["False", "ERROR"]
    # the user's own `import torch` installs rpcnb's pickler for plain torch RPC
    out = kernel.execute("import torch.distributed.rpc\nimport rpcnb.paths.serialize as s\n"
                         "print(s.is_installed())")
    assert out.stdout.split() == ["True"]


def test_device_map_is_checked_before_anything_starts(rpcnb_kernel):
    # on any machine: a map onto a GPU worker1 does not have (worker1 sees this kernel's
    # GPUs), refused in seconds with the member and the device named, nothing started
    gpus = torch_gpus()
    before = set(children_of(rpcnb_kernel.pid))
    t0 = time.monotonic()
    bad = rpcnb_kernel.execute(f"%rpc_init --workers 1 --device-map 1_0_{gpus}", allow_error=True)
    assert time.monotonic() - t0 < 15  # torch's own check: a minute (importing torch is most of this)
    if gpus == 0:
        assert "this machine has no CUDA devices" in bad.traceback
    else:
        assert f"worker1 has only {gpus} CUDA device" in bad.traceback
        assert f"cuda:{gpus} in the map for worker1 does not exist there" in bad.traceback
    assert set(children_of(rpcnb_kernel.pid)) == before  # nothing was started
    dup = rpcnb_kernel.execute("%rpc_init --workers 1 --device-map 1_0_0,1_1_0", allow_error=True)
    assert "duplicated target device" in dup.traceback
    bad = rpcnb_kernel.execute("%rpc_init --workers 2 --gpus 0,1,2", allow_error=True)
    assert "--gpus '0,1,2'" in bad.traceback
    bad = rpcnb_kernel.execute(f"%rpc_init --workers 1 --gpus {gpus}", allow_error=True)
    assert f"this kernel sees {gpus} GPU" in bad.traceback
    assert set(children_of(rpcnb_kernel.pid)) == before
    rpcnb_kernel.execute("%rpc_init --workers 1 --device-map \"{'worker1': {'cpu': 'cpu'}}\"")
    maps = rpcnb_kernel.value("{k: {str(a): str(b) for a, b in v.items()} for k, v in __import__("
                        "'torch').distributed.rpc.api._get_current_rpc_agent()"
                        "._get_backend_options().device_maps.items()}")
    assert maps == {"worker1": {"cpu": "cpu"}}
    # the map is the kernel's own: the worker it started has none
    assert rpcnb_kernel.execute(
        "%%remote worker1 --fetch\nimport torch.distributed.rpc as rpc\n"
        "len(rpc.api._get_current_rpc_agent()._get_backend_options().device_maps)").text == "0"
    assert rpcnb_kernel.execute("%%remote worker1 --fetch\n3").text == "3"


def test_init_prints_group_and_join_line(rpcnb_kernel):
    out = rpcnb_kernel.execute("%rpc_init --workers 2")
    lines = out.stdout.splitlines()
    table = "\n".join(lines)
    for name in ("worker0", "worker1", "worker2"):
        assert name in table
    join = [ln.strip() for ln in lines if ln.strip().startswith("%rpc_init --join")]
    assert join and join[0].endswith("--name NAME")
    conn = join[0].split()[2]
    assert conn.endswith("/connection.json")
    assert oct(os.stat(conn).st_mode & 0o777) == "0o600"  # the secret is this user's only
    pids = worker_pids(rpcnb_kernel)
    assert pids["worker0"] == rpcnb_kernel.pid
    assert all(pid_alive(pids[n]) for n in ("worker1", "worker2"))
    assert str(pids["worker1"]) in table and str(pids["worker2"]) in table
    assert out.stderr == ""


def test_group_listens_on_loopback_only(group):
    # every socket of the kernel (its own ZMQ ports included) and of each worker
    for name, pid in worker_pids(group).items():
        addrs = listening_addresses(pid)
        assert addrs, f"{name} listens nowhere? (TensorPipe should)"
        for addr in addrs:
            assert addr.rsplit(":", 1)[0] in ("127.0.0.1", "::1"), f"{name} listens on {addr}"


def test_remote_cell_keeps_result_remote(group):
    out = group.execute(
        "%%remote worker1\nimport torch\nx = torch.arange(6.).reshape(2, 3)\n"
        "print('on', x.device)\nx * 2"
    )
    assert out.stdout == "on cpu\n"
    text = out.text
    assert text.startswith("RRef on worker1: torch.Tensor shape=(2, 3) float32 cpu 24 B")
    assert "10." in text  # the preview
    assert "shape" in out.results[0]["text/html"]
    fetched = group.execute("%%remote worker1 --fetch\nx.sum()")
    assert fetched.text == "tensor(15.)"
    # the value lives on worker1, not in the notebook
    assert group.value("'x' in globals()") is False


def test_namespace_persists_push_and_bind(group):
    group.execute("%%remote worker2\ncounter = 10")
    group.execute("%%remote worker2\ncounter += 5")
    group.execute("scale = 3")
    group.execute("%%remote worker2 --push scale -o r\ncounter * scale")
    assert group.value("r.to_here()") == 45
    assert group.value("type(r).__name__") in ("PyRRef", "RRef")
    line = group.execute("%remote worker2 counter + 1")
    assert line.text.startswith("RRef on worker2: int")
    assert group.execute("%remote --fetch worker2 counter - 1").text == "14"
    assert group.execute("%remote --all --fetch 2 * 21").text == "{'worker1': 42, 'worker2': 42}"


def test_output_streams_while_the_cell_runs(group):
    out = group.execute(
        "%%remote worker1\nimport sys, time\nprint('first', flush=True)\n"
        "print('to stderr', file=sys.stderr)\ntime.sleep(2)\nprint('second')"
    )
    first = next(t for t, kind, text in out.events if kind == "stdout" and "first" in text)
    assert out.finished - first > 1.5, "output arrived only at the end of the cell"
    assert out.stdout == "first\nsecond\n"
    assert out.stderr == "to stderr\n"


def test_display_output_reaches_the_cell(group):
    out = group.execute(
        "%%remote worker1\nfrom IPython.display import display, HTML\n"
        "display(HTML('<b>from worker1</b>'))\nprint('after')"
    )
    assert any("<b>from worker1</b>" in d["data"].get("text/html", "") for d in out.displays)
    assert out.stdout == "after\n"


def test_matplotlib_figures_from_a_worker_show_in_the_cell(group):
    out = group.execute("%%remote worker1\n%matplotlib inline\nimport matplotlib.pyplot as plt\n"
                        "plt.plot([1, 2, 3])\nplt.show()")
    assert any("image/png" in d["data"] for d in out.displays)


def test_several_workers_run_in_parallel_with_prefixes(group):
    out = group.execute(
        "%%remote --all\nimport time, os\nprint('start')\ntime.sleep(1.5)\nprint('end')\nos.getpid()"
    )
    # both started before either ended: they ran at the same time, not one after another
    order = [ln.split()[1] for ln in out.stdout.splitlines()]
    assert order[:2] == ["start", "start"], out.stdout
    lines = sorted(out.stdout.splitlines())
    assert lines == ["[worker1] end", "[worker1] start", "[worker2] end", "[worker2] start"]
    assert "'worker1': RRef on worker1: int" in out.text
    both = group.execute("%%remote worker1,worker2 --fetch\nimport os\nos.getpid()")
    pids = worker_pids(group)
    assert both.text == repr({"worker1": pids["worker1"], "worker2": pids["worker2"]})


def test_a_worker_set_names_several_workers_wherever_workers_are_named(group):
    pids = worker_pids(group)
    both = repr({"worker1": pids["worker1"], "worker2": pids["worker2"]})
    assert group.execute("%%remote worker1-2 --fetch\nimport os\nos.getpid()").text == both
    assert group.execute("%%remote worker2,worker1 --fetch\nimport os\nos.getpid()").text == \
        repr({"worker2": pids["worker2"], "worker1": pids["worker1"]})
    host = group.value("__import__('socket').gethostname()")
    assert group.execute(f"%%remote @{host} --fetch\n1").text == "{'worker1': 1, 'worker2': 1}"
    assert group.value("sorted(__import__('rpcnb').run('worker1-2', '1', fetch=True))") == \
        ["worker1", "worker2"]
    stacks = group.execute("%rpc_stacks worker1-2").text
    assert "worker1: runs no cell now" in stacks and "worker2: runs no cell now" in stacks, \
        stacks
    out = group.execute("%%remote worker2-9\n1", allow_error=True)
    assert out.traceback.startswith("UsageError: worker2-9 names worker3-9, which are not in "
                                    "this group (it has worker0-2)."), out.traceback
    out = group.execute("%rpc_who worker[1:8]", allow_error=True)
    assert "'worker[1:8]' is not a worker set" in out.traceback, out.traceback


def test_the_same_error_on_several_workers_shows_once_with_its_set(group):
    out = group.execute("%%remote --all\nx = 1\n1 / x // 0", allow_error=True)
    assert out.error["ename"] == "CompositeRemoteError", out.error
    shown = out.traceback
    assert shown.startswith("CompositeRemoteError: 2 workers raised ZeroDivisionError: "
                            "float floor division by zero (worker1,worker2)"), shown
    assert shown.count("RemoteError: ZeroDivisionError on worker1,worker2") == 1, shown
    assert shown.count("1 / x // 0") == 1, shown  # one traceback for both
    # each worker's own error is kept, and the group goes on
    assert group.value("sorted(__import__('sys').last_value.errors)") == ["worker1", "worker2"]
    assert group.execute("%%remote worker2 --fetch\nx + 1").text == "2"


def test_worker_lines_never_land_inside_a_line_the_kernel_is_printing(group):
    """``print`` writes its text and its newline in two calls; workers' lines that arrive
    in between wait for the newline (a kernel thread serving RPC prints while they do)."""
    out = group.execute(
        "import sys, threading, time, rpcnb\n"
        "def kernel_prints():\n"
        "    for i in range(40):\n"
        "        sys.stdout.write(f'K{i}')\n"
        "        time.sleep(0.02)\n"
        "        sys.stdout.write('\\n')\n"
        "t = threading.Thread(target=kernel_prints)\n"
        "t.start()\n"
        "rpcnb.run(rpcnb.ALL, 'import time\\nfor i in range(80):\\n    print(f\"W{i}\")\\n"
        "    time.sleep(0.01)')\n"
        "t.join()"
    )
    lines = out.stdout.splitlines()
    bad = [ln for ln in lines if not re.fullmatch(r"K\d+|\[worker[12]\] W\d+", ln)]
    assert not bad, f"lines mixed up: {bad}\n{out.stdout}"
    assert sum(ln.startswith("K") for ln in lines) == 40
    assert sum(ln.startswith("[worker") for ln in lines) == 160


def test_notebook_code_works_as_rpc_targets(group):
    group.execute(
        "import torch, torch.distributed.rpc as rpc\n"
        "def helper():\n    return 'notebook'\n"
        "def add(a, b):\n    return a + b\n"
        "class Counter:\n    def __init__(self, start):\n        self.n = start\n"
        "    def bump(self, k):\n        self.n += k\n        return self.n\n"
    )
    # the worker has its own function of the same name: the notebook's must run
    group.execute("%%remote worker1\ndef helper():\n    return 'worker'")
    assert group.value("rpc.rpc_sync('worker1', helper)") == "notebook"
    assert group.value("rpc.rpc_sync('worker1', add, args=(torch.ones(2), 1)).tolist()") == [2.0, 2.0]
    assert group.value("rpc.rpc_sync('worker2', lambda v: v * 7, args=(6,))") == 42
    group.execute("c = rpc.remote('worker2', Counter, args=(5,))")
    assert group.value("c.rpc_sync().bump(3)") == 8
    assert group.value("c.owner().name") == "worker2"
    # rpcnb's own cells can use notebook functions pushed by value
    assert group.execute("%%remote worker2 --push add --fetch\nadd(20, 22)").text == "42"


def test_seed_recipe_cpu_mode_with_distributed_autograd(group):
    src = SEED.read_text()
    start = src.index("class MyModule")
    end = src.index("def run_worker")
    recipe = src[start:end]
    # CPU devices instead of cuda:0 / cuda:1, as on a machine without GPUs
    recipe = recipe.replace('torch.cuda.current_stream("cuda:0").synchronize()', "pass")
    recipe = recipe.replace('"cuda:0"', '"cpu"').replace('"cuda:1"', '"cpu"')
    recipe = recipe.replace(".cuda(0)", "")
    group.execute(
        "import torch\nimport torch.distributed.autograd as autograd\n"
        "import torch.distributed.rpc as rpc\nimport torch.nn as nn\nimport time\n" + recipe
    )
    out = group.execute('measure(comm_mode="cpu")')
    assert "cpu RPC" in out.stdout
    # the gradients of both shards exist after a distributed backward
    check = group.execute(
        "lm = MyModule('cpu', 'cpu')\nrm = rpc.remote('worker1', MyModule, args=('cpu', 'cpu'))\n"
        "x = torch.randn(8, 1000)\n"
        "with autograd.context() as ctx:\n"
        "    y = rm.rpc_sync().forward(lm(x))\n"
        "    autograd.backward(ctx, [y.sum()])\n"
        "    grads = autograd.get_gradients(ctx)\n"
        "print(len(grads), all(p in grads for p in lm.parameters()))"
    )
    assert check.stdout.split() == ["2", "True"]


def test_remote_error_names_worker_and_cell_line(group):
    group.execute("%%remote worker1\nkept = 'still here'")
    out = group.execute("%%remote worker1\na = 1\nb = 2\nb / (a - 1)", allow_error=True)
    assert out.error["ename"] == "RemoteError"
    tb = out.traceback
    assert "ZeroDivisionError on worker1" in tb
    # the cell after the one that kept `kept`, and its line
    cell = int(re.search(r'File "<worker1 cell (\d+)>", line 3', tb).group(1))
    assert group.execute("%%remote worker1 --fetch\nkept").text == "'still here'"
    again = group.execute("%%remote worker1\n1 / 0", allow_error=True).traceback
    assert f'File "<worker1 cell {cell + 2}>", line 1' in again, again
    assert "b / (a - 1)" in tb
    assert "rpcnb" not in tb.split("\n", 1)[1]  # no rpcnb internals in the remote part
    assert group.execute("%%remote worker1 --fetch\nkept").text == "'still here'"
    # the API raises RemoteError with .worker
    api = group.execute(
        "import rpcnb\ntry:\n    rpcnb.run('worker2', 'undefined_name')\n"
        "except rpcnb.RemoteError as e:\n    print(e.worker, e.ename)"
    )
    assert api.stdout.split() == ["worker2", "NameError"]
    syntax = group.execute("%%remote worker1\nx = 1\nif x\n    pass", allow_error=True)
    assert "SyntaxError" in syntax.traceback and "line 2" in syntax.traceback
    # the same cell again (compiled once, rpcnb.cells.runner._compiled): the traceback
    # names the cell that ran, a function it defined included
    again = "%%remote worker1\ndef f():\n    return 1 / 0\nf()"
    first = group.execute(again, allow_error=True).traceback
    second = group.execute(again, allow_error=True).traceback
    one, two = re.findall(r"<worker1 cell (\d+)>", first), re.findall(r"<worker1 cell (\d+)>", second)
    assert one and two and len(set(one)) == 1 and set(two) == {str(int(one[0]) + 1)}, (first, second)
    assert "return 1 / 0" in second
    # a plain cell with no code of its own runs the code of its first run again
    # (rpcnb.cells.runner.run_source): its traceback names the run all the same
    leaf = "%%remote worker1\nz = 0\n1 / z"
    first = group.execute(leaf, allow_error=True).traceback
    second = group.execute(leaf, allow_error=True).traceback
    one, two = re.findall(r"<worker1 cell (\d+)>", first), re.findall(r"<worker1 cell (\d+)>", second)
    assert one and two and set(two) == {str(int(one[0]) + 1)}, (first, second)
    assert "1 / z" in second and "line 2" in second, second
    # a cell sent to several: one raises, the other's result is not lost
    both = group.execute("%%remote --all --fetch\nimport torch.distributed.rpc as rpc\n"
                         "me = rpc.get_worker_info().name\n1 / 0 if me == 'worker1' else me * 2",
                         allow_error=True)
    assert "ZeroDivisionError" in both.traceback and "worker1" in both.traceback, both
    assert "worker2 finished" in both.traceback and "worker2worker2" in both.traceback, both
    group.execute("import sys")
    assert group.value("sys.last_value.results") == {"worker2": "worker2worker2"}


@pytest.mark.serial  # times what the user waits: seconds
def test_interrupt_stops_remote_code_and_keeps_worker(group):
    group.execute("%%remote worker1\nsafe = [1, 2, 3]")
    out = group.execute(
        "%%remote worker1\nimport time\nwhile True:\n    time.sleep(0.01)",
        allow_error=True, interrupt_after=1.0, timeout=30,
    )
    at = next(t for t, kind, _ in out.events if kind == "interrupt")
    assert out.error is not None and "KeyboardInterrupt" in out.error["ename"]
    assert out.finished - at < 2.0
    # a single long sleep in C is interrupted too
    out = group.execute("%%remote worker1\nimport time\ntime.sleep(60)",
                        allow_error=True, interrupt_after=1.0, timeout=30)
    at = next(t for t, kind, _ in out.events if kind == "interrupt")
    assert out.finished - at < 2.0
    assert group.execute("%%remote worker1 --fetch\nsum(safe)").text == "6"


@pytest.mark.serial  # times what the user waits: seconds
def test_killed_worker_fails_fast_and_group_survives(own_group):
    pids = worker_pids(own_group)
    own_group.kc.execute("%%remote worker1\nimport time\nprint('running', flush=True)\n"
                         "time.sleep(30)")  # a pending call
    while True:  # it runs on worker1: its first line has reached the notebook
        msg = own_group.kc.get_iopub_msg(timeout=30)
        if msg["msg_type"] == "stream" and "running" in msg["content"]["text"]:
            break
    killed_at = time.monotonic()
    os.kill(pids["worker1"], signal.SIGKILL)
    out = None
    # the pending cell ends with a clear error
    while out is None:
        msg = own_group.kc.get_iopub_msg(timeout=10)
        if msg["msg_type"] == "error":
            out = msg["content"]
    assert time.monotonic() - killed_at < 5
    text = "\n".join(out["traceback"])
    assert "worker1" in text and "SIGKILL" in text
    own_group.execute("pass")  # wait for that cell to finish
    later = own_group.execute("%%remote worker1\n1", allow_error=True)
    assert "worker1" in later.traceback and "died" in later.traceback
    assert own_group.execute("%%remote worker2 --fetch\n2 + 2").text == "4"
    table = own_group.execute("%rpc_workers").text
    assert "killed by SIGKILL" in table
    # the dead member no longer poisons the group: shutdown is quick and clean
    t0 = time.monotonic()
    own_group.execute("%rpc_shutdown")
    assert time.monotonic() - t0 < 10
    assert not pid_alive(pids["worker2"])


def test_shutdown_leaves_nothing_and_init_works_again(own_group):
    pids = worker_pids(own_group)
    t0 = time.monotonic()
    out = own_group.execute("%rpc_shutdown")
    assert time.monotonic() - t0 < 15
    assert "left the group" in out.stdout
    assert not any(pid_alive(pids[n]) for n in ("worker1", "worker2"))
    assert out.stderr == ""
    own_group.execute("%rpc_init --workers 1")
    assert own_group.execute("%%remote worker1 --fetch\n6 * 7").text == "42"
    new = worker_pids(own_group)
    assert new["worker1"] != pids["worker1"]
    own_group.execute("%rpc_shutdown")
    assert not pid_alive(new["worker1"])


RREF_CELL = """
import torch
import torch.distributed.rpc as rpc
import torch.nn as nn

class Scale(nn.Module):
    def __init__(self, k):
        super().__init__()
        self.k = k

    def forward(self, x):
        return x * self.k

def use(worker):
    rm = rpc.remote(worker, Scale, args=(3.0,))
    return rm.owner_name(), rm.rpc_sync().forward(torch.ones(2)).tolist()

class Box:
    def __init__(self, n):
        self.n = n

def read(box):
    return box.local_value().n

def hand_back(box):  # on a worker: the kernel's RRef goes back to the kernel
    return rpc.rpc_sync("worker0", read, args=(box,))

def handed(worker):
    return rpc.rpc_sync(worker, hand_back, args=(rpc.RRef(Box(7)),))
"""


def test_torch_rrefs_and_their_proxies_work_in_the_kernels_next_group(rpcnb_kernel):
    # torch builds its RRef bookkeeping on a process's first agent and keeps it: in a
    # kernel's second group, owner() asked that shut-down agent ("could not find
    # destination id 1"), and so did RRef proxies (the CUDA recipe's rm.rpc_sync().forward)
    # and an RRef a worker hands back to the kernel (torch's RL and parameter-server
    # programs); in every group of the kernel (this one may have run others before)
    for workers in (1, 2, 1):  # worker2: an id the group before never had
        rpcnb_kernel.execute(f"%rpc_init --workers {workers}")
        rpcnb_kernel.execute(RREF_CELL)
        for worker in [f"worker{i}" for i in range(1, workers + 1)]:
            assert rpcnb_kernel.execute(f"use({worker!r})").text == f"({worker!r}, [3.0, 3.0])"
            assert rpcnb_kernel.execute(f"handed({worker!r})").text == "7"
        rpcnb_kernel.execute("%rpc_shutdown")


def test_second_kernel_joins_and_runs_cells_in_its_own_namespace(own_group, kernel_factory):
    join_line = next(
        ln.strip() for ln in own_group.execute("%rpc_workers").text.splitlines()
        if ln.strip().startswith("%rpc_init --join")
    ).replace("NAME", "alice")
    other = kernel_factory()
    other.execute("%load_ext rpcnb")
    other.execute("secret = 41")
    joined = other.execute(join_line)
    assert "alice" in joined.stdout
    out = own_group.execute("%%remote alice --fetch\nprint('hello from alice')\nsecret + 1")
    assert out.text == "42"
    assert out.stdout == "hello from alice\n"
    own_group.execute("%%remote alice\nmade_remotely = 'yes'")
    assert other.value("made_remotely") == "yes"
    # and alice can drive the workers too
    assert other.execute("%%remote worker1 --fetch\n40 + 2").text == "42"
    taken = kernel_factory()
    taken.execute("%load_ext rpcnb")
    dup = taken.execute(join_line, allow_error=True)
    assert "already taken" in dup.traceback
    own_group.execute("%rpc_shutdown")
    assert other.value("__import__('rpcnb.api').api.is_initialized()") is False


def test_rpc_workers_table(group):
    group.execute("%%remote worker1\n1")
    text = group.execute("%rpc_workers").text
    header = text.splitlines()[1].split()
    assert header[:7] == ["name", "rank", "host", "address", "pid", "kind", "devices"]
    assert "alive" in header and "calls" in header and "recent" in header
    rows = {ln.split()[0]: ln.split() for ln in text.splitlines()[2:5]}
    assert rows["worker1"][1] == "1" and rows["worker2"][1] == "2"
    # where each member's TensorPipe listens: loopback, named with its interface
    assert all("127.0.0.1 (lo)" in " ".join(row) for row in rows.values()), text
    assert "process" in rows["worker1"] and "kernel" in rows["worker0"]


def test_bad_input_gets_one_clear_sentence(group):
    cases = {
        "%%remote worker9\n1": "There is no worker 'worker9'",
        "%%remote\n1": "Name the worker(s) to run on",
        "%%remote worker1\n   \n": "The cell is empty",
        "%%remote worker1 --push nope\n1": "no variable 'nope'",
        "%remote worker1": "Give the expression to run",
        "%rpc_init --workers 1": "already in an RPC group",
        "%rpc_workers extra": "takes no arguments",
        "%%remote worker1 --timeout -1\n1": "positive number",
    }
    for code, sentence in cases.items():
        out = group.execute(code, allow_error=True)
        assert out.traceback.startswith("UsageError: "), (code, out.traceback)
        assert sentence in out.traceback, (code, out.traceback)
    assert group.execute("%%remote worker1 --fetch\n'still fine'").text == "'still fine'"
    # the Python API: a rank is not a name (it says which name has it); torch's WorkerInfo is
    group.execute("import rpcnb, torch.distributed.rpc as rpc")
    for code, sentence in {"rpcnb.run(1, '1')": "got 1 (int) (rank 1 is 'worker1')",
                           "rpcnb.run([2.5], '1')": "got 2.5 (float)"}.items():
        out = group.execute(code, allow_error=True)
        assert "RpcnbError: A worker is named by its name" in out.traceback, (code, out.traceback)
        assert sentence in out.traceback and "%rpc_workers lists" in out.traceback, out.traceback
    assert group.value("rpcnb.run(rpc.get_worker_info('worker2'), '40 + 2', fetch=True)") == 42
    # several names in any iterable: a dict of results keyed by name, a generator
    group.execute("got = rpcnb.run(['worker1', 'worker2'], '1', fetch=True)")
    assert group.value("rpcnb.run(got, '2', fetch=True)") == {"worker1": 2, "worker2": 2}
    assert group.value("rpcnb.run((n for n in got), '3', fetch=True)") == {"worker1": 3,
                                                                         "worker2": 3}


def test_magics_need_a_group_first(rpcnb_kernel):
    out = rpcnb_kernel.execute("%%remote worker1\n1", allow_error=True)
    assert "run %rpc_init" in out.traceback
    out = rpcnb_kernel.execute("%rpc_shutdown", allow_error=True)
    assert "run %rpc_init" in out.traceback


@pytest.mark.serial  # times what the user waits: seconds
def test_timeout_interrupts_the_cell(group):
    out = group.execute("%%remote worker1 --timeout 1\nimport time\ntime.sleep(30)",
                        allow_error=True, timeout=20)
    assert "did not finish within 1 s" in out.traceback
    assert out.finished - out.started < 5
    assert group.execute("%%remote worker1 --fetch\n'alive'").text == "'alive'"


def test_python_api_from_a_script(tmp_path):
    import subprocess
    import sys

    script = tmp_path / "drive.py"
    script.write_text(
        "import rpcnb\n"
        "g = rpcnb.init(2)\n"
        "print(sorted(m.name for m in g.members))\n"
        "r = rpcnb.run('worker1', 'import torch\\nt = torch.ones(3)\\nt * 2')\n"
        "print(r.to_here().tolist())\n"
        "print(rpcnb.run(rpcnb.ALL, '1 + 1', fetch=True))\n"
        "rpcnb.shutdown()\n"
        "print('done')\n"
    )
    returncode, stdout, stderr, seen = run_watched(
        [sys.executable, str(script)], timeout=120, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)
    assert returncode == 0, stderr
    assert len(seen) >= 3  # the script and its two workers
    assert stdout.splitlines() == [
        "['worker0', 'worker1', 'worker2']", "[2.0, 2.0, 2.0]",
        "{'worker1': 2, 'worker2': 2}", "done",
    ]


def test_workers_exit_when_the_kernel_dies(own_kernel_group):
    pids = worker_pids(own_kernel_group)
    group_dir = Path(own_kernel_group.value(
        "str(__import__('rpcnb.session.state').session.state.current().group_dir)"))
    assert (group_dir / "connection.json").exists()
    os.kill(own_kernel_group.pid, signal.SIGKILL)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and any(
            pid_alive(pids[n]) for n in ("worker1", "worker2")):
        time.sleep(0.1)
    assert not any(pid_alive(pids[n]) for n in ("worker1", "worker2"))
    # the group's directory, with the secret in its connection file, went with them
    assert not group_dir.exists()


def test_init_sweeps_the_directories_of_dead_groups(rpcnb_kernel, tmp_path):
    import json
    import subprocess
    import tempfile

    # a group directory whose first kernel is gone (killed before its workers could clean
    # up), and one of a kernel still running: the next %rpc_init removes only the first
    gone = subprocess.Popen(["true"])
    gone.wait()
    boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    made = {}
    for tag, pid in (("dead", gone.pid), ("alive", os.getpid())):
        d = Path(tempfile.mkdtemp(prefix="rpcnb-"))
        (d / "connection.json").write_text(json.dumps({
            "address": f"file://{d}/store", "secret": "0" * 32, "leader": "worker0",
            "leader_pid": pid, "boot_id": boot}))
        made[tag] = d
    try:
        rpcnb_kernel.execute("%rpc_init --workers 1")
        assert not made["dead"].exists()
        assert made["alive"].exists()
        rpcnb_kernel.execute("%rpc_shutdown")
    finally:
        import shutil

        for d in made.values():
            shutil.rmtree(d, ignore_errors=True)


def test_worker_exiting_inside_a_cell_then_shutdown_and_init(own_group):
    out = own_group.execute("%%remote worker1\nimport os\nos._exit(1)", allow_error=True)
    assert "worker1" in out.traceback and "exited with code 1" in out.traceback
    t0 = time.monotonic()
    own_group.execute("%rpc_shutdown")
    assert time.monotonic() - t0 < 10
    own_group.execute("%rpc_init --workers 1")
    assert own_group.execute("%%remote worker1 --fetch\n'back'").text == "'back'"
    own_group.execute("%rpc_shutdown")


def test_tensor_extraction_handles_notebook_classes(group):
    # With a device map, torch's C++ finds the CUDA tensors inside a Python result by
    # pickling it (torch._jit_internal._extract_tensors, plain pickle): a result holding
    # an instance of a class the notebook shipped (the CUDA RPC recipe's module, created
    # with rpc.remote) must get through. The same call, on the worker, on CPU:
    group.execute(
        "import torch, torch.distributed.rpc as rpc\n"
        "class Shard(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.w = torch.nn.Parameter(torch.ones(3))\n"
        "        self.extra = torch.zeros(2)\n"
        "def extract_there():\n"
        "    import torch._jit_internal as jit\n"
        "    found = jit._extract_tensors([Shard(), {'t': torch.arange(4)}])\n"
        "    return sorted(tuple(t.shape) for t in found)\n"
    )
    assert group.value("rpc.rpc_sync('worker1', extract_there)") == [(2,), (3,), (4,)]


def test_gpus_per_worker_and_auto_device_maps(rpcnb_kernel):
    # --gpus none: workers see no GPU; --gpus auto: one each, round-robin, numbered from
    # cuda:0 in each worker; --device-map auto: every member maps each GPU to the same
    # index on every other member that has it (on a CPU machine: no map at all)
    gpus = torch_gpus()
    rpcnb_kernel.execute("%rpc_init --workers 2 --gpus none --device-map auto")
    seen = rpcnb_kernel.execute("%%remote --all --fetch\nimport os, torch\n"
                          "(os.environ.get('CUDA_VISIBLE_DEVICES'), torch.cuda.device_count())")
    assert seen.text == "{'worker1': ('', 0), 'worker2': ('', 0)}"
    rows = {ln.split()[0]: ln for ln in rpcnb_kernel.execute("%rpc_workers").text.splitlines()
            if ln.startswith("worker")}
    assert " cpu " in rows["worker1"] and " cpu " in rows["worker2"]
    rpcnb_kernel.execute("%rpc_shutdown")
    rpcnb_kernel.execute("%rpc_init --workers 2 --gpus auto --device-map auto")
    seen = rpcnb_kernel.execute("%%remote --all --fetch\nimport torch\ntorch.cuda.device_count()")
    assert seen.text == repr({"worker1": min(gpus, 1), "worker2": min(gpus, 1)})
    maps = rpcnb_kernel.execute(
        "%%remote --all --fetch\nimport torch.distributed.rpc as rpc\n"
        "{p: {str(a): str(b) for a, b in m.items()} for p, m in "
        "rpc.api._get_current_rpc_agent()._get_backend_options().device_maps.items()}")
    if gpus == 0:
        assert ast.literal_eval(maps.text) == {"worker1": {}, "worker2": {}}
    else:  # worker to worker goes direct: each maps its cuda:0 onto the other's cuda:0
        assert ast.literal_eval(maps.text) == {
            "worker1": {"worker0": {"cuda:0": "cuda:0"}, "worker2": {"cuda:0": "cuda:0"}},
            "worker2": {"worker0": {"cuda:0": "cuda:0"}, "worker1": {"cuda:0": "cuda:0"}}}
        assert "(GPU " in rpcnb_kernel.execute("%rpc_workers").text
    rpcnb_kernel.execute("%rpc_shutdown")
