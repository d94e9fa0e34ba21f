"""NumPy, CuPy and other DLPack arrays take the tensor paths (issue 13): wrapped without a
copy, sent as tensors (shared memory for large CPU ones on one host), rebuilt as the same
array type; what DLPack refuses is pickled as before; copy semantics as for tensors; the
RRef display says shape, dtype, device and size.

Most tests run with this test process as worker0 (the Python API) and real worker
processes; one drives a real kernel through the magics. CuPy tests are marked ``gpu``.
"""

from __future__ import annotations

import dataclasses
import sys

import cloudpickle
import numpy as np
import pytest
import torch
import torch.distributed.rpc as rpc
from conftest import Seen, started_here, wait_until

import rpcnb
from rpcnb.observe import values
from rpcnb.paths import arrays, serialize, shm
from rpcnb.wire import _torch

MB = 1 << 20
# The workers cannot import this test module: ship its functions by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


@dataclasses.dataclass
class Batch:
    x: object
    y: object
    step: int


def echo(x):
    return x


def described(x):
    """What arrived, said on the receiving side."""
    return type(x).__module__, type(x).__qualname__, str(getattr(x, "dtype", "")), \
        tuple(getattr(x, "shape", ()))


def ns():
    from rpcnb.session import state

    return state.current().runner.namespace


def keep(x):
    ns()["kept"] = x
    return float(np.asarray(x).sum())


def kept_sum():
    return float(np.asarray(ns()["kept"]).sum())


def bump_kept():
    ns()["kept"] += 100
    return True


def drop_kept():
    ns().pop("kept", None)
    return True


def worker_shm_stats():
    from rpcnb.paths import shm as s

    return s.stats()


@pytest.fixture(scope="module")
def api_group():
    # where there is a GPU, with device maps, so that the CuPy tests share the group
    seen = Seen()
    gpu = {"cuda:0": "cuda:0"}
    rpcnb.init(2, device_map={"worker1": gpu, "worker2": gpu} if torch.cuda.is_available()
               else None)
    try:
        seen.update(started_here())
        yield seen
    finally:
        seen.update(started_here())
        try:
            rpcnb.shutdown()
        finally:
            seen.kill()


def same(a, b) -> bool:
    return type(a) is type(b) and a.dtype == b.dtype and a.shape == b.shape and \
        np.array_equal(a, b, equal_nan=a.dtype.kind in "fc")


DTYPES = ["bool", "float16", "float32", "float64", "complex64", "complex128", "int8", "uint8",
          "int16", "int32", "int64", "uint16", "uint32", "uint64"]


def sample(dtype: str, n: int = 7) -> np.ndarray:
    rng = np.random.default_rng(13)
    if dtype == "bool":
        return rng.random(n) > 0.5
    if dtype.startswith("complex"):
        return (rng.standard_normal(n) + 1j * rng.standard_normal(n)).astype(dtype)
    if dtype.startswith("float"):
        a = rng.standard_normal(n).astype(dtype)
        a[0] = np.nan  # NaN and infinities arrive as they are
        a[1] = -np.inf
        return a
    info = np.iinfo(dtype)
    return np.array([info.min, info.max, 0, 1, 2, 3, 4][:n], dtype=dtype)


def shapes() -> dict[str, np.ndarray]:
    base = np.arange(24, dtype=np.float64).reshape(4, 6)
    return {
        "0-d": np.array(3.25, dtype=np.float32),
        "empty": np.zeros((0, 3), dtype=np.int32),
        "empty 1-d": np.array([], dtype=np.complex64),
        "2-d": base,
        "Fortran-ordered": np.asfortranarray(base),
        "transposed": base.T,
        "every other column": base[:, ::2],
        "reversed (negative strides)": base[::-1, ::-1],
        "broadcast (zero strides)": np.broadcast_to(np.arange(3.0), (4, 3)),
        "read-only": _read_only(np.arange(5)),
        "3-d slice": np.arange(60, dtype=np.int16).reshape(3, 4, 5)[1:, ::2, 1:4],
    }


def _read_only(a: np.ndarray) -> np.ndarray:
    a.setflags(write=False)
    return a


# --------------------------------------------------------------------------- no group


def test_arrays_become_tensors_without_a_copy_and_refused_ones_are_pickled():
    serialize.install()
    pickler = _torch.rpc_pickler()
    a = np.arange(16384, dtype=np.float32)  # 64 KB
    data, tensors = pickler.serialize(a)
    assert len(tensors) == 1 and len(data) < 1024  # the bytes are not in the pickle
    assert tensors[0].data_ptr() == a.ctypes.data  # the array's own memory
    for refused in (np.array([1, "a", None], dtype=object), np.array(["ab", "c"]),
                    np.arange(3, dtype=">i4"), np.zeros(2, dtype=[("a", "i4"), ("b", "f8")]),
                    np.array(["2020-01-01"], dtype="datetime64[D]"), np.ones(2, np.longdouble),
                    np.float32(2.5), np.int64(7),
                    np.ma.masked_array([1.0, 2.0], mask=[False, True])):  # a subclass: the mask
        data, tensors = pickler.serialize(refused)
        assert tensors == [], type(refused)
        back = pickler.deserialize(data, tensors)
        assert type(back) is type(refused)
        assert repr(back) == repr(refused)


def test_the_array_path_can_be_turned_off():
    serialize.install()
    pickler = _torch.rpc_pickler()
    a = np.arange(1000, dtype=np.float64)
    arrays.set_enabled(False)
    try:
        data, tensors = pickler.serialize(a)
    finally:
        arrays.set_enabled(True)
    assert tensors == [] and len(data) > a.nbytes  # the bytes are in the pickle
    assert same(pickler.deserialize(data, tensors), a)
    data, tensors = pickler.serialize(a)
    assert len(tensors) == 1 and len(data) < 1024  # on again


def test_the_tensor_extractor_finds_arrays_as_tensors():
    # with a device map, torch looks for CUDA tensors in Python values by pickling them:
    # an array is found as its tensor (a CuPy array is then not copied to the host)
    serialize.install()
    found = _torch.extract_tensors([np.ones(3), {"x": np.arange(2)}, np.array(["a"])])
    assert [tuple(t.shape) for t in found] == [(3,), (2,)]


def test_array_types_are_recognised_by_name_once_per_type():
    assert arrays.library(np.ndarray) == "numpy"
    assert arrays.library(torch.Tensor) is None  # tensors have their own path
    assert arrays.library(np.ma.MaskedArray) is None and arrays.library(np.memmap) is None
    assert arrays.library(np.float32) is None and arrays.library(dict) is None
    hits = arrays.library.cache_info().hits
    assert arrays.library(np.ndarray) == "numpy" and arrays.library(dict) is None
    assert arrays.library.cache_info().hits == hits + 2  # cached


def test_describe_an_array():
    info = values.describe(np.arange(12, dtype=np.float32).reshape(3, 4))
    assert (info["type"], info["shape"], info["dtype"], info["device"], info["nbytes"]) == \
        ("numpy.ndarray", [3, 4], "float32", "cpu", 48)
    assert info["preview"].startswith("array([[ 0.,  1.,  2.,  3.],")
    big = values.describe(np.zeros((1000, 1000)))
    assert big["shape"] == [1000, 1000] and big["nbytes"] == 8_000_000
    assert "..." in big["preview"] and len(big["preview"]) < 400
    scalar = values.describe(np.array(1.5))
    assert scalar["shape"] == [] and scalar["preview"] == "array(1.5)"
    refused = values.describe(np.array([None, "a"], dtype=object))  # pickled, still an array
    assert (refused["shape"], refused["dtype"]) == ([2], "object")


# --------------------------------------------------------------------------- in a group


def test_every_dtype_round_trips_as_numpy(api_group):
    for dtype in DTYPES:
        a = sample(dtype)
        assert rpc.rpc_sync("worker1", described, args=(a,)) == \
            ("numpy", "ndarray", dtype, (7,))
        back = rpc.rpc_sync("worker1", echo, args=(a,))  # argument and result
        assert same(back, a), (dtype, back, a)


def test_every_shape_round_trips(api_group):
    for name, a in shapes().items():
        back = rpc.rpc_sync("worker2", echo, args=(a,))
        assert same(back, a), name
        assert back.flags.writeable, name  # the receiver's own array
    # Fortran order survives the tensor table (as it does pickling)
    assert rpc.rpc_sync("worker2", echo, args=(shapes()["Fortran-ordered"],)).flags.f_contiguous


def test_large_arrays_take_shared_memory_both_ways(api_group):
    a = np.random.default_rng(0).standard_normal(MB // 2)  # 4 MB
    f = np.asfortranarray(np.arange(MB, dtype=np.int32).reshape(1024, 1024))
    for x in (a, f, np.arange(2 * MB, dtype=np.uint8) % 7 == 0):
        before = shm.stats()
        back = rpc.rpc_sync("worker1", echo, args=(x,))
        after = shm.stats()
        assert same(back, x)
        assert after["sent"] == before["sent"] + 1  # the argument
        assert after["received"] == before["received"] + 1  # the result


def test_nested_in_lists_dicts_and_dataclasses(api_group):
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    big = np.ones(MB, dtype=np.float32)
    value = {"a": a, "list": [a, np.array([True, False]), torch.ones(2)],
             "batch": Batch(np.zeros(3, np.int8), big, 4), "text": "plain"}
    back = rpc.rpc_sync("worker2", echo, args=(value,))
    assert same(back["a"], a) and same(back["list"][1], value["list"][1])
    assert back["list"][0] is back["a"]  # one array, twice in a message: one array there
    assert torch.equal(back["list"][2], torch.ones(2))
    assert type(back["batch"]).__name__ == "Batch" and back["batch"].step == 4
    assert same(back["batch"].x, np.zeros(3, np.int8)) and same(back["batch"].y, big)


def test_arrays_dlpack_refuses_arrive_pickled(api_group):
    for a in (np.array([1, "a", None], dtype=object), np.array(["x", "yz"]),
              np.arange(4, dtype=">f8"), np.zeros(3, dtype=[("a", "i4"), ("b", "f4")])):
        back = rpc.rpc_sync("worker1", echo, args=(a,))
        assert type(back) is np.ndarray and back.dtype == a.dtype
        assert back.tolist() == a.tolist()
    masked = np.ma.masked_array([1.0, 2.0, 3.0], mask=[False, True, False])
    back = rpc.rpc_sync("worker1", echo, args=(masked,))
    assert type(back) is np.ma.MaskedArray and back.mask.tolist() == [False, True, False]
    assert rpc.rpc_sync("worker1", echo, args=(np.float16(1.5),)) == np.float16(1.5)


@pytest.mark.parametrize("size", [16, MB], ids=["tensor table", "shared memory"])
def test_copy_semantics_both_ways(api_group, size):
    a = np.ones(size, dtype=np.float32)
    total = float(size)
    assert rpc.rpc_sync("worker1", keep, args=(a,)) == total
    a += 1  # the sender changes its array: the receiver's must not change
    assert rpc.rpc_sync("worker1", kept_sum) == total
    rpc.rpc_sync("worker1", bump_kept)  # and the receiver's writes never reach the sender
    assert np.all(a == 2)
    # an array that shares memory with a tensor: neither the tensor's changes reach the
    # receiver, nor the receiver's the tensor
    t = torch.zeros(size)
    shared = t.numpy()
    assert rpc.rpc_sync("worker2", keep, args=(shared,)) == 0.0
    t.add_(5)
    assert rpc.rpc_sync("worker2", kept_sum) == 0.0
    rpc.rpc_sync("worker2", bump_kept)
    assert torch.all(t == 5)
    # an array that arrived (over shared memory when large) is the receiver's own: the
    # sender's next send of the same size does not reuse its buffer, and writes stay here
    back = rpc.rpc_sync("worker1", echo, args=(a,))
    again = rpc.rpc_sync("worker1", echo, args=(np.zeros(size, dtype=np.float32),))
    assert np.all(back == 2) and np.all(again == 0)
    back += 1
    assert np.all(a == 2) and rpc.rpc_sync("worker1", kept_sum) == 101 * size
    for w in ("worker1", "worker2"):
        rpc.rpc_sync(w, drop_kept)


def test_received_arrays_give_their_buffer_back_when_freed(api_group):
    # the echo comes back by handle over the buffer our send filled (rpcnb.paths.zerocopy)
    before = worker_shm_stats()["in_flight"]
    back = rpc.rpc_sync("worker1", echo, args=(np.zeros(MB, dtype=np.float32),))
    control = rpc.rpc_sync("worker1", echo, args=(np.ones(MB, dtype=np.float32),))
    view = back[10:20]
    assert worker_shm_stats()["in_flight"] == before + 2  # our buffers, held by the results
    del back
    del control
    # the control's buffer comes back (freed after `back`'s): had `back`'s been freed, it
    # would be back by now too; the view holds it
    assert wait_until(lambda: worker_shm_stats()["in_flight"] == before + 1)
    del view
    assert wait_until(lambda: worker_shm_stats()["in_flight"] == before)


def test_push_fetch_and_to_here_of_remote_cells(api_group):
    big = np.arange(MB, dtype=np.float32)
    before = shm.stats()
    out = rpcnb.run("worker1", "big * 2", push={"big": big}, fetch=True)  # --push, --fetch
    assert same(out, big * 2)
    after = shm.stats()
    assert after["sent"] == before["sent"] + 1 and after["received"] == before["received"] + 1
    small = rpcnb.run("worker1", "(type(small).__name__, small.dtype.name, small)",
                      push={"small": np.array([1, 2], np.int8)}, fetch=True)
    assert small[:2] == ("ndarray", "int8") and same(small[2], np.array([1, 2], np.int8))
    r = rpcnb.run("worker2", "import numpy as np\nnp.full((1024, 1024), 3, np.float32)")
    fetched = r.to_here()  # to_here() of rpcnb's result: shared memory again
    assert same(fetched, np.full((1024, 1024), 3, np.float32))
    assert shm.stats()["received"] == after["received"] + 1
    r0 = rpcnb.run("worker2", "np.array(7, np.uint8)")
    assert same(r0.to_here(), np.array(7, np.uint8))


def test_rref_display_of_an_array(api_group):
    from rpcnb.frontend import rrefs

    r = rpcnb.run("worker1", "import numpy as np\nnp.arange(12, dtype=np.float16).reshape(3, 4)")
    text = rrefs.rref_text(r)
    assert text.startswith("RRef on worker1: numpy.ndarray shape=(3, 4) float16 cpu 24 B\n")
    assert "array([[ 0.,  1.,  2.,  3.]," in text
    html = rrefs.rref_html(r)
    assert "float16" in html and "(3, 4)" in html


def test_other_dlpack_arrays_round_trip_as_their_own_type(api_group):
    xp = pytest.importorskip("array_api_strict")  # a DLPack array library other than NumPy
    a = xp.asarray(np.arange(12.0).reshape(3, 4))
    assert arrays.library(type(a)) == "array_api_strict"
    back = rpc.rpc_sync("worker1", echo, args=(a,))
    assert type(back) is type(a) and np.array_equal(np.from_dlpack(back), np.from_dlpack(a))
    rev = xp.flip(xp.asarray(np.arange(MB, dtype=np.float32)))  # large, negative strides
    before = shm.stats()["sent"]
    back = rpc.rpc_sync("worker1", echo, args=(rev,))
    assert type(back) is type(rev) and np.array_equal(np.from_dlpack(back), np.from_dlpack(rev))
    assert shm.stats()["sent"] == before + 1
    info = values.describe(a)
    assert (info["shape"], info["dtype"], info["device"], info["nbytes"]) == \
        ([3, 4], "float64", "cpu", 96)


# --------------------------------------------------------------------------- a kernel


def test_magics_push_fetch_and_display_arrays_and_load_ext_stays_light(kernel):
    out = kernel.execute("import sys\nbefore = {m for m in ('numpy', 'cupy', 'torch') "
                         "if m in sys.modules}\n%load_ext rpcnb\n"
                         "print(sorted(before), sorted(m for m in ('numpy', 'cupy', 'torch') "
                         "if m in sys.modules))")
    assert out.stdout.split() == ["[]", "[]"]  # %load_ext rpcnb imports none of them
    kernel.execute("%rpc_init --workers 1")
    kernel.execute("import numpy as np\na = np.arange(2**20, dtype=np.float32).reshape(1024, -1)")
    got = kernel.execute("%%remote worker1 --push a --fetch\n(type(a).__name__, a.dtype.name)")
    assert got.text == "('ndarray', 'float32')"
    kernel.execute("%%remote worker1 --push a --fetch -o back\na[::-1] + 1")
    assert kernel.value("bool((back == a[::-1] + 1).all()) and type(back).__name__") == "ndarray"
    shown = kernel.execute("%%remote worker1\nimport numpy as np\n"
                           "np.ones((2, 3), dtype=np.complex64)")
    assert shown.text.startswith(
        "RRef on worker1: numpy.ndarray shape=(2, 3) complex64 cpu 48 B\narray([[1.+0.j,")
    assert "complex64" in shown.results[0]["text/html"]
    kernel.execute("r = _")
    assert kernel.value("(type(r.to_here()).__name__, r.to_here().dtype.name)") == \
        ("ndarray", "complex64")
    assert kernel.value("'cupy' in sys.modules") is False  # NumPy arrays never import it
    kernel.execute("%rpc_shutdown")


# --------------------------------------------------------------------------- CuPy (GPU)


def _cupy():
    """CuPy, or a skip that says what this machine lacks: a CUDA device (asked of torch
    and of the driver's device files) and an importable CuPy."""
    import glob
    import importlib.util

    lacks = []
    if not torch.cuda.is_available():
        lacks.append(f"no CUDA device (torch {torch.__version__}: cuda.is_available() is "
                     f"False; /dev/nvidia[0-9]*: {len(glob.glob('/dev/nvidia[0-9]*'))} found)")
    if importlib.util.find_spec("cupy") is None:
        major = (torch.version.cuda or "12").split(".")[0]
        lacks.append(f"CuPy is not installed (pip install cupy-cuda{major}x on a CUDA machine)")
    if lacks:
        pytest.skip("CuPy arrays cannot be tested here: " + "; ".join(lacks))
    import cupy

    if not cupy.cuda.is_available():
        pytest.skip("CuPy is installed but sees no CUDA device (cupy.cuda.is_available())")
    return cupy


@pytest.mark.gpu
def test_cupy_arrays_round_trip_on_the_gpu(request):
    cupy = _cupy()  # skips (saying why) before the group is asked for
    request.getfixturevalue("api_group")
    for a in (cupy.arange(12, dtype=cupy.float32).reshape(3, 4),
              cupy.asfortranarray(cupy.ones((64, 64), dtype=cupy.complex64)),
              cupy.arange(10, dtype=cupy.int8)[::-1], cupy.zeros((0,), cupy.float16),
              cupy.random.random(25 * MB // 8)):
        back = rpc.rpc_sync("worker1", echo, args=(a,))
        assert type(back) is cupy.ndarray and back.dtype == a.dtype and back.shape == a.shape
        assert back.device.id == 0 and bool((back == a).all())
        assert rpc.rpc_sync("worker1", described, args=(a,))[:2] == ("cupy", "ndarray")
    a = cupy.ones(1000, dtype=cupy.float32)
    out = rpcnb.run("worker1", "(type(a).__module__, a * 2)", push={"a": a}, fetch=True)
    assert out[0] == "cupy" and bool((out[1] == 2).all())
    a += 1  # copy semantics
    assert rpcnb.run("worker1", "float(a.sum())", fetch=True) == 1000.0
    r = rpcnb.run("worker1", "import cupy\ncupy.full((256, 256), 3, cupy.float32)")
    assert bool((r.to_here() == 3).all())
    from rpcnb.frontend import rrefs

    assert rrefs.rref_text(r).startswith(
        "RRef on worker1: cupy.ndarray shape=(256, 256) float32 cuda:0 256.0 KB")
