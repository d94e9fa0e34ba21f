"""Planning GPUs before anything starts: which GPUs each worker gets (``--gpus``), the
``auto`` device maps, and a joining kernel's map against the members already in. These
are rpcnb's own rules on device lists, so they run on any machine; what only a GPU can
show is in the ``gpu``-marked tests at the end (they skip without CUDA, and say why)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import Seen, run_watched

from rpcnb.wire import options

VISIBLE = ["0", "1", "2"]


def test_gpu_plans():
    assert options.plan_gpus(None, 2, VISIBLE) is None  # workers see what the kernel sees
    assert options.plan_gpus("none", 2, VISIBLE) == [[], []]
    assert options.plan_gpus("auto", 4, VISIBLE) == [[0], [1], [2], [0]]
    assert options.plan_gpus("auto", 2, []) == [[], []]  # no GPU: nobody gets one
    assert options.plan_gpus("1,2", 2, VISIBLE) == [[1], [2]]
    assert options.plan_gpus("0+1,2", 2, VISIBLE) == [[0, 1], [2]]
    assert options.plan_gpus("2", 3, VISIBLE) == [[2], [2], [2]]  # one entry for all


@pytest.mark.parametrize(("spec", "words"), [
    ("0,1,2", "has 3 entries for 2 workers"),
    ("3", "this kernel sees 3 GPUs (cuda:0..cuda:2), so GPU 3 does not exist here"),
    ("x", "is not a GPU plan"),
    ("0,,1", "is not a GPU plan"),
    ("-1", "is not a GPU plan"),
])
def test_bad_gpu_plans_say_what_to_do(spec, words):
    with pytest.raises(ValueError, match="use auto|one entry per worker|0,1"):
        options.plan_gpus(spec, 2, VISIBLE)
    with pytest.raises(ValueError) as err:
        options.plan_gpus(spec, 2, VISIBLE)
    assert words in str(err.value)


def test_auto_maps_every_gpu_to_the_same_index_for_every_member():
    devices = {"worker0": ["cuda:0", "cuda:1"], "worker1": ["cuda:0"], "worker2": ["cuda:0"],
               "worker3": []}
    maps = options.auto_device_maps(devices)
    assert maps["worker0"] == {"worker1": {"cuda:0": "cuda:0"}, "worker2": {"cuda:0": "cuda:0"}}
    assert maps["worker1"] == {"worker0": {"cuda:0": "cuda:0"}, "worker2": {"cuda:0": "cuda:0"}}
    assert "worker3" not in maps  # no GPU: CPU tensors only


def test_a_joiner_is_checked_against_the_members_already_in():
    members = {"worker0": {"devices": ["cuda:0", "cuda:1"],
                           "device_map": {"alice": {"cuda:0": "cuda:1"}}},
               "worker1": {"devices": ["cuda:0"], "device_map": {}}}
    # worker0 sends to alice's cuda:1: a joiner with one GPU is refused before it joins
    with pytest.raises(ValueError, match="worker0's device map sends to alice's cuda:1, "
                                         "but alice has cuda:0"):
        options.join_device_map("alice", None, ["cuda:0"], members)
    assert options.join_device_map("alice", None, ["cuda:0", "cuda:1"], members) is None
    # the joiner's own map onto a GPU worker1 does not have
    with pytest.raises(ValueError, match="worker1 has only 1 CUDA device"):
        options.join_device_map("alice", {"worker1": {0: 1}}, ["cuda:0", "cuda:1"], members)
    assert options.join_device_map("alice", "auto", ["cuda:0", "cuda:1"], members) == {
        "worker0": {"cuda:0": "cuda:0", "cuda:1": "cuda:1"}, "worker1": {"cuda:0": "cuda:0"}}


def test_the_ucx_extra_is_the_one_built_for_this_torchs_cuda():
    import torch

    # read from torch's version.py without importing torch, as the kernel asks before it
    # starts anything; the same as torch's own answer, on a CPU build and on CUDA builds
    assert options.torch_cuda_version() == torch.version.cuda
    assert options.ucx_extra("13.0") == "ucx-cu13"
    assert options.ucx_extra("12.8") == "ucx"
    assert options.ucx_extra() == (
        "ucx-cu13" if (torch.version.cuda or "").startswith("13.") else "ucx")
    extras = _extras()
    # every extra the advice names exists, with the ucxx wheel of that CUDA major
    assert extras["ucx"] == ["ucxx-cu12>=0.52"]
    assert extras["ucx-cu13"] == ["ucxx-cu13>=0.52"]


def _extras() -> dict[str, list[str]]:
    tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11")
    with open(Path(__file__).parents[2] / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]["optional-dependencies"]


# -- on a GPU machine -------------------------------------------------------------------

SEED = Path(__file__).parents[1] / "data" / "cuda_rpc_recipe.txt"


def _gpus() -> int:
    import torch

    return torch.cuda.device_count()


needs_cuda = pytest.mark.skipif(_gpus() == 0, reason=(
    "needs a CUDA device: this torch sees none, so there is no device-mapped path, no CUDA "
    "IPC and no CUDA tensor to extract from a result"))


@pytest.mark.parametrize("comm_mode", ["cpu", "cuda"])
@pytest.mark.gpu
@needs_cuda
def test_the_recipe_pasted_as_is_runs_in_both_modes(kernel, comm_mode):
    # the recipe's MyModule and measure, pasted into a cell unchanged; with one GPU
    # both processes use cuda:0 (map {0: 0}), with two the recipe's {0: 1}
    src = SEED.read_text()
    recipe = src[src.index("class MyModule"):src.index("def run_worker")]
    remote = "cuda:1" if _gpus() >= 2 else "cuda:0"
    if remote == "cuda:0":
        recipe = recipe.replace('"cuda:1"', '"cuda:0"')
    kernel.execute("%load_ext rpcnb")
    kernel.execute(f"%rpc_init --workers 1 --device-map \"{{'worker1': {{0: {remote[-1]}}}}}\"")
    kernel.execute("import torch\nimport torch.distributed.autograd as autograd\n"
                   "import torch.distributed.rpc as rpc\nimport torch.nn as nn\nimport time\n"
                   + recipe)
    out = kernel.execute(f'measure(comm_mode="{comm_mode}")', timeout=300)
    assert f"{comm_mode} RPC" in out.stdout
    kernel.execute("%rpc_shutdown")


@pytest.mark.gpu
@needs_cuda
def test_cuda_tensors_go_device_to_device_between_workers(kernel):
    kernel.execute("%load_ext rpcnb")
    kernel.execute("%rpc_init --workers 2 --gpus auto --device-map auto")
    kernel.execute("import torch\nt = torch.arange(6., device='cuda:0')")
    out = kernel.execute("%%remote worker1 --push t --fetch\n"
                         "import torch.distributed.rpc as rpc\n"
                         "def double(x):\n    return x * 2\n"
                         "back = rpc.rpc_sync('worker2', double, args=(t,))\n"
                         "(str(t.device), str(back.device), back.sum().item())")
    assert out.text == "('cuda:0', 'cuda:0', 30.0)"
    fetched = kernel.execute("%%remote worker1 --fetch\nt + 1\n")
    assert "device='cuda:0'" in fetched.text
    kernel.execute("%rpc_shutdown")


# -- make gpu-check, on a machine without a GPU ------------------------------------------

ROOT = Path(__file__).resolve().parents[2]


def _gpu_tests_pytest_collects(config: pytest.Config, session: pytest.Session) -> list[str]:
    """The ids of every gpu-marked test, as pytest collects them from the whole suite: this
    run's own collection when it is the whole suite (make test: every test module is
    imported already), else a collection of its own."""
    whole = [Path(config.invocation_params.dir, a).resolve() for a in config.args] == \
        [ROOT / "tests"] and not config.option.keyword and \
        config.option.markexpr in ("", "not serial")
    if whole:
        return [item.nodeid.rsplit("@", 1)[0] for item in session.items
                if item.get_closest_marker("gpu")]
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "gpu",
                          "-p", "no:cacheprovider", "tests"], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    return [line for line in out.stdout.splitlines() if "::" in line]


@pytest.mark.skipif(_gpus() > 0, reason="on a GPU machine gpu-check is the GPU run itself: "
                    "make gpu-check")
def test_gpu_check_without_a_gpu_says_so_and_rehearses_every_step(request):
    script = [sys.executable, str(ROOT / "scripts" / "gpu_check.py")]
    code, out, err, _ = run_watched(script, 120, cwd=ROOT, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True)
    assert code == 0, err[-2000:]
    assert "no CUDA device here" in out and "nothing to check" in out
    # --rehearse: the same steps as on a GPU machine, collecting only the files that hold
    # gpu tests (a GPU machine has none of the browser's or the clusters' packages)
    ids = _gpu_tests_pytest_collects(request.config, request.session)
    files = sorted({i.split("::")[0] for i in ids})
    code, out, err, _ = run_watched([*script, "--rehearse"], 600, cwd=ROOT,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert code == 0, out[-3000:] + err[-2000:]
    table = {line.split("  ")[0]: line for line in out.splitlines()}
    assert (f"0 passed, 0 failed, {len(ids)} skipped in {len(files)} files"
            in table["gpu tests"]), out[-3000:]
    assert "ok: no CUDA, nothing measured" in table["GPU benchmark"]
    assert all(f in out for f in files), "every gpu test's file ran, and said why it skipped"


@pytest.mark.gpu
@needs_cuda
def test_rpc_workers_shows_each_members_gpu_memory(kernel):
    """A worker that allocates on its GPU shows it in %rpc_workers: allocated and reserved
    grow, total is the device's."""
    kernel.execute("%load_ext rpcnb")
    kernel.execute("%rpc_init --workers 1 --gpus auto")
    kernel.execute("%%remote worker1\nimport torch\nbig = torch.ones(256, 1024, 1024, device='cuda')")
    table = kernel.execute("%rpc_workers").text
    row = next(ln for ln in table.splitlines() if ln.startswith("worker1"))
    assert "cuda:0 1.0 GB alloc" in row, table
    assert "reserved /" in row and "CUDA not initialised" not in row


@pytest.mark.gpu
@needs_cuda
def test_rpc_groups_shows_a_kept_groups_gpu_memory(tmp_path):
    """A kept group's worker that allocates on its GPU shows it in %rpc_groups, as
    %rpc_workers shows it (its keeper asks it every 10 s). A runtime folder of the test's
    own; the keeper, in a session of its own, is stopped by the pids of its record."""
    import json

    from conftest import Kernel, children_of, wait_until


    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    k = Kernel(env={"RPCNB_RUNTIME_DIR": str(run)})
    pids = Seen()
    try:
        k.execute("%load_ext rpcnb")
        k.execute("%rpc_init --workers 1 --gpus auto --keep 10m")
        rec = json.loads(next(run.glob("kept/*/record.json")).read_text())
        pids |= [rec["pid"], *rec["workers"].values(), *children_of(rec["pid"])]
        k.execute("%%remote worker1\nimport torch\n"
                  "big = torch.ones(256, 1024, 1024, device='cuda')")
        said: list[str] = []

        def listed() -> bool:
            said[:] = [k.execute("%rpc_groups").stdout]
            return "worker1 cuda:0 1.0 GB alloc" in said[0]

        assert wait_until(listed, 30, poll=1.0), said
        k.execute("%rpc_shutdown")
    finally:
        k.close()
        pids.kill()


# -- collectives under NCCL --------------------------------------------------------------

COLL = "import torch\nimport torch.distributed as dist\n"


@pytest.mark.gpu
@needs_cuda
def test_nccl_all_reduces_cuda_tensors_with_a_gpu_per_rank(kernel):
    """As many workers as GPUs (one on a one-GPU machine): nccl forms, each rank on a GPU
    of its own; all_reduce of CUDA tensors and DDP on CUDA work next to RPC."""
    n = _gpus()
    kernel.execute("%load_ext rpcnb")
    out = kernel.execute(f"%rpc_init --workers {n} --collectives nccl --collective-timeout 20")
    assert "the workers form a process group (nccl)" in out.stdout, out.stdout + out.stderr
    got = kernel.execute("%%remote --all --fetch\n" + COLL +
                         "t = torch.ones(4, device='cuda') * (dist.get_rank() + 1)\n"
                         "dist.all_reduce(t)\n"
                         "from torch.nn.parallel import DistributedDataParallel as DDP\n"
                         "m = DDP(torch.nn.Linear(4, 1).cuda())\n"
                         "m(torch.randn(8, 4, device='cuda')).sum().backward()\n"
                         "(dist.get_backend(), torch.cuda.current_device(), float(t[0]), "
                         "m.module.weight.grad.is_cuda)", timeout=180)
    results = eval(got.text)  # noqa: S307 - the kernel's own output
    assert len(results) == n, got.text
    want = float(n * (n + 1) // 2)
    for backend, _device, total, grad_on_gpu in results.values():
        assert backend == "nccl" and total == want and grad_on_gpu, got.text
    kernel.execute("%rpc_shutdown")


@pytest.mark.gpu
@needs_cuda
def test_nccl_with_more_workers_than_gpus_is_refused_and_auto_takes_gloo(kernel):
    """NCCL takes one GPU per rank: with more workers than GPUs, nccl is refused at start
    with a sentence naming the workers that would share one; auto picks gloo, says why."""
    n = _gpus() + 1
    kernel.execute("%load_ext rpcnb")
    out = kernel.execute(f"%rpc_init --workers {n} --collectives nccl", allow_error=True)
    assert "share one GPU" in out.stderr and "--collectives gloo" in out.stderr, out.stderr
    assert "rpc_init" in kernel.execute("%rpc_workers", allow_error=True).stderr  # none left
    out = kernel.execute(f"%rpc_init --workers {n} --collectives auto --collective-timeout 20")
    assert "process group (gloo, since" in out.stdout and "share one GPU" in out.stdout, out.stdout
    got = kernel.execute("%%remote --all --fetch\n" + COLL +
                         "t = torch.ones(1)\ndist.all_reduce(t)\nfloat(t)", timeout=120)
    assert set(eval(got.text).values()) == {float(n)}, got.text  # noqa: S307
    kernel.execute("%rpc_shutdown")


@pytest.mark.gpu
@needs_cuda
def test_empty_cuda_tensors_travel_and_keep_their_device(kernel):
    """An empty CUDA tensor owns no memory, and TensorPipe aborts the sending process on
    its null pointer: in an rpcnb group it arrives, empty, on the mapped device."""
    kernel.execute("%load_ext rpcnb")
    kernel.execute("%rpc_init --workers 2 --gpus auto --device-map auto")
    kernel.execute("import torch\ne = torch.empty(0, 3, device='cuda:0')")
    out = kernel.execute("%%remote worker1 --push e --fetch\n"
                         "import torch.distributed.rpc as rpc\n"
                         "def same(x):\n    return x\n"
                         "back = rpc.rpc_sync('worker2', same, args=(e,))\n"
                         "(str(e.device), tuple(e.shape), str(back.device), tuple(back.shape))")
    assert out.text == "('cuda:0', (0, 3), 'cuda:0', (0, 3))", out.text + out.stderr
    assert kernel.execute("%%remote worker1 --fetch\nback.dtype").text == "torch.float32"
    kernel.execute("%rpc_shutdown")


PAIRS = ("import torch\nimport torch.distributed.rpc as rpc\n"
         "def double(x):\n    return x * 2\n"
         "me = rpc.get_worker_info().name\n"
         "peers = sorted(i.name for i in rpc.api._get_current_rpc_agent().get_worker_infos()"
         " if i.name != me)\n"
         "got = {p: str(rpc.rpc_sync(p, double, args=(t,)).device) for p in peers}\n")


@pytest.mark.gpu
@needs_cuda
def test_every_member_replies_with_cuda_tensors_to_every_other(kernel):
    """CUDA tensors both ways between every ordered pair of members, whichever joined
    first: torch's dynamic groups leave an earlier member without the reverse map of a
    later one's device map, so its reply with a CUDA tensor failed."""
    kernel.execute("%load_ext rpcnb")
    kernel.execute("%rpc_init --workers 2 --gpus auto --device-map auto")
    kernel.execute("import torch\nt = torch.ones(4, device='cuda:0')")
    here = kernel.execute(PAIRS + "got")
    assert here.text == "{'worker1': 'cuda:0', 'worker2': 'cuda:0'}", here.text + here.stderr
    there = kernel.execute("%%remote --all --push t --fetch\n" + PAIRS + "got")
    assert eval(there.text) == {  # noqa: S307 - the kernel's own output
        "worker1": {"worker0": "cuda:0", "worker2": "cuda:0"},
        "worker2": {"worker0": "cuda:0", "worker1": "cuda:0"}}, there.text + there.stderr
    kernel.execute("%rpc_shutdown")
