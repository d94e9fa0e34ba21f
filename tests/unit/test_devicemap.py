"""The device-map model: both input forms, every validation rule and message, writing back,
and applying to torch's real TensorPipeRpcBackendOptions (which only stores the maps, so
no GPU is needed). Fast: no process is started (that importing the module imports no
torch takes a fresh interpreter: tests/build/test_imports.py).
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rpcnb.wire import devicemap as dmod
from rpcnb.wire.devicemap import DeviceMap, Pair, Problem

FAST = settings(max_examples=150, deadline=None)


def messages(problems: list[Problem]) -> list[str]:
    return [problem.message for problem in problems]


@pytest.fixture(scope="module")
def torch():
    return pytest.importorskip("torch")


@pytest.fixture
def options(torch):
    from torch.distributed.rpc import TensorPipeRpcBackendOptions

    return TensorPipeRpcBackendOptions()


# -- reading: the dict form -----------------------------------------------------------------


def test_dict_form_with_ints_strings_and_cpu():
    dm = DeviceMap.parse({"worker1": {0: 1, "cuda:2": "cuda:3"}, "worker2": {"cpu": 0, 1: "cpu"}})
    assert dm.to_dict() == {
        "worker1": {"cuda:0": "cuda:1", "cuda:2": "cuda:3"},
        "worker2": {"cpu": "cuda:0", "cuda:1": "cpu"},
    }


def test_dict_form_takes_torch_devices(torch):
    dm = DeviceMap.parse({"worker1": {torch.device("cuda:1"): torch.device("cpu")}})
    assert dm.to_dict() == {"worker1": {"cuda:1": "cpu"}}


def test_dict_form_normalises_spelling():
    dm = DeviceMap.parse({" worker1 ": {" CUDA:01 ": "2", "Cpu": "cuda:0"}})
    assert dm.to_dict() == {"worker1": {"cuda:1": "cuda:2", "cpu": "cuda:0"}}


def test_dict_form_int_peer_is_a_rank():
    assert DeviceMap.parse({1: {0: 1}}).peers == ("worker1",)
    assert DeviceMap.parse({1: {0: 1}}, names={1: "trainer"}).peers == ("trainer",)


def test_dict_form_keeps_devices_torch_would_refuse_for_validate():
    dm = DeviceMap.parse({"worker1": {-1: "gpu0", "cuda:x": "cuda"}})
    assert dm.to_dict() == {"worker1": {"cuda:-1": "gpu0", "cuda:x": "cuda"}}


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ([1, 2], dmod.PARSE_SPEC.format(kind="a list")),
        (3, dmod.PARSE_SPEC.format(kind="a int")),
        ({"worker1": [0, 1]}, dmod.PARSE_PEER_MAP.format(peer="worker1", kind="a list")),
        ({"worker1": {0.5: 1}}, dmod.PARSE_DEVICE.format(device=0.5, peer="worker1")),
        ({"worker1": {0: None}}, dmod.PARSE_DEVICE.format(device=None, peer="worker1")),
        ({"worker1": {True: 1}}, dmod.PARSE_DEVICE.format(device=True, peer="worker1")),
        ({"": {0: 1}}, dmod.PARSE_PEER.format(peer="")),
        ({-1: {0: 1}}, dmod.PARSE_PEER.format(peer=-1)),
        ({False: {0: 1}}, dmod.PARSE_PEER.format(peer=False)),
        ({None: {0: 1}}, dmod.PARSE_PEER.format(peer=None)),
    ],
)
def test_dict_form_errors(spec, message):
    with pytest.raises(ValueError) as info:
        DeviceMap.parse(spec)
    assert str(info.value) == message


# -- reading: DI-engine's string form -------------------------------------------------------


def test_string_form_ranks_default_to_workerN():
    dm = DeviceMap.parse("1_0_1,2_0_2")
    assert dm.to_dict() == {"worker1": {"cuda:0": "cuda:1"}, "worker2": {"cuda:0": "cuda:2"}}


def test_string_form_ranks_through_names():
    dm = DeviceMap.parse("1_0_1,2_1_0", names={1: "learner", 2: "collector"})
    assert dm.to_dict() == {"learner": {"cuda:0": "cuda:1"}, "collector": {"cuda:1": "cuda:0"}}


def test_string_form_names_may_hold_underscores_and_whitespace_is_tolerated():
    dm = DeviceMap.parse("  my_trainer_2 _ 0 _1 ,\t3_1_0 ,  ")
    assert dm.to_dict() == {"my_trainer_2": {"cuda:0": "cuda:1"}, "worker3": {"cuda:1": "cuda:0"}}


@pytest.mark.parametrize("spec", ["", "  ", ",", None])
def test_empty_specs_give_an_empty_map(spec):
    dm = DeviceMap.parse(spec)
    assert len(dm) == 0 and dm.to_dict() == {} and dm.validate() == []


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("1_0", dmod.PARSE_ITEM.format(item="1_0")),
        ("_0_1", dmod.PARSE_ITEM.format(item="_0_1")),
        ("1_0_1,worker", dmod.PARSE_ITEM.format(item="worker")),
        ("1_a_1", dmod.PARSE_INDEX.format(field="a", item="1_a_1")),
        ("1_0_1.5", dmod.PARSE_INDEX.format(field="1.5", item="1_0_1.5")),
        ("1_0_cuda:1", dmod.PARSE_INDEX.format(field="cuda:1", item="1_0_cuda:1")),
        ("1_0_", dmod.PARSE_INDEX.format(field="", item="1_0_")),
    ],
)
def test_string_form_errors(spec, message):
    with pytest.raises(ValueError) as info:
        DeviceMap.parse(spec)
    assert str(info.value) == message


def test_exact_repeats_collapse_as_in_torch():
    assert DeviceMap.parse("1_0_1,1_0_1") == DeviceMap.parse("1_0_1")
    assert len(DeviceMap.parse("1_0_1,1_0_1")) == 1


def test_parse_a_device_map_keeps_its_pairs():
    dm = DeviceMap.parse("1_0_1", me="worker0")
    again = DeviceMap.parse(dm, names={1: "worker1"})
    assert again == dm and again.me == "worker0" and again.names == {1: "worker1"}


# -- what a map says ------------------------------------------------------------------------


def test_peers_local_devices_and_inverse():
    dm = DeviceMap.parse({"worker2": {10: 0, 2: 1}, "worker1": {"cpu": 3, 0: 2}})
    assert dm.peers == ("worker2", "worker1")
    assert dm.local_devices() == ["cpu", "cuda:0", "cuda:2", "cuda:10"]
    assert dm.local_devices("worker2") == ["cuda:2", "cuda:10"]
    assert dm.inverse("worker1") == {"cuda:3": "cpu", "cuda:2": "cuda:0"}
    assert dm.inverse("nobody") == {}


def test_inverse_of_a_many_to_one_map_is_refused():
    dm = DeviceMap.parse({"worker1": {0: 1, 2: 1}})
    with pytest.raises(ValueError) as info:
        dm.inverse("worker1")
    assert str(info.value) == dmod.DUPLICATED_TARGET.format(
        sources="cuda:0 and cuda:2", device="cuda:1", peer="worker1"
    )


def test_equality_ignores_order_and_hash_agrees():
    a = DeviceMap.parse("1_0_1,2_1_0")
    b = DeviceMap.parse({"worker2": {1: 0}, "worker1": {0: 1}}, me="worker0")
    assert a == b and hash(a) == hash(b)
    assert a != DeviceMap.parse("1_0_2")
    assert a != {"worker1": {"cuda:0": "cuda:1"}}
    assert list(a) == [Pair("worker1", "cuda:0", "cuda:1"), Pair("worker2", "cuda:1", "cuda:0")]


# -- validate: every rule, every message ----------------------------------------------------


def test_a_valid_map_has_no_problems():
    dm = DeviceMap.parse("1_0_1,1_1_0,2_0_0", me="worker0", names={0: "worker0", 1: "worker1"})
    dm = DeviceMap.parse(dm, names={0: "worker0", 1: "worker1", 2: "worker2"})
    local = ["cuda:0", "cuda:1"]
    assert dm.validate(local, {"worker1": local, "worker2": ["cuda:0"]}) == []
    assert dm.check(local) is dm


@pytest.mark.parametrize(
    ("device", "reason"),
    [
        ("cuda:-1", dmod.REASON_NEGATIVE),
        ("gpu0", dmod.REASON_UNKNOWN_TYPE),
        ("meta", dmod.REASON_UNKNOWN_TYPE),
        ("cuda:x", dmod.REASON_NOT_A_NUMBER),
        ("cuda", dmod.REASON_NO_INDEX),
    ],
)
def test_invalid_devices_on_either_side(device, reason):
    for spec in ({"worker1": {device: 0}}, {"worker1": {0: device}}):
        problems = DeviceMap.parse(spec).validate()
        expected = dmod.INVALID_DEVICE.format(device=device, peer="worker1", reason=reason)
        assert problems == [Problem("worker1", device, expected)]


def test_negative_index_in_the_string_form():
    problems = DeviceMap.parse("1_-1_0").validate()
    assert messages(problems) == [
        dmod.INVALID_DEVICE.format(device="cuda:-1", peer="worker1", reason=dmod.REASON_NEGATIVE)
    ]


def test_cpu_may_be_mapped_both_ways_as_torch_allows():
    dm = DeviceMap.parse({"worker1": {"cpu": 0, 1: "cpu"}}, me="worker0")
    assert dm.validate(["cuda:0", "cuda:1"], {"worker1": ["cuda:0"]}) == []
    # cpu needs no GPU on either side
    assert DeviceMap.parse({"worker1": {"cpu": "cpu"}}).validate([], {"worker1": []}) == []


def test_duplicated_device_in_the_string_form():
    problems = DeviceMap.parse("1_0_1,1_0_2").validate()
    assert problems == [
        Problem(
            "worker1",
            "cuda:0",
            dmod.DUPLICATED_DEVICE.format(
                device="cuda:0", targets="cuda:1 and cuda:2", peer="worker1"
            ),
        )
    ]


def test_duplicated_target_device():
    problems = DeviceMap.parse({"worker1": {0: 1, 2: 1, "cpu": "cuda:1"}}).validate()
    assert problems == [
        Problem(
            "worker1",
            "cuda:1",
            dmod.DUPLICATED_TARGET.format(
                sources="cuda:0 and cuda:2 and cpu", device="cuda:1", peer="worker1"
            ),
        )
    ]


def test_the_same_device_on_two_peers_is_fine():
    assert DeviceMap.parse("1_0_0,2_0_0").validate() == []


def test_local_index_beyond_the_device_count():
    problems = DeviceMap.parse("1_2_0", me="worker0").validate(["cuda:0", "cuda:1"])
    expected = dmod.LOCAL_TOO_FEW.format(
        me="worker0", count=2, s="s", available="cuda:0, cuda:1", device="cuda:2", peer="worker1"
    )
    assert problems == [Problem("worker1", "cuda:2", expected)]
    assert "worker0 has only 2 CUDA devices" in expected


def test_local_count_of_one_is_singular_and_me_defaults_to_this_worker():
    (problem,) = DeviceMap.parse("1_1_0").validate(["cpu", "cuda:0"])
    assert problem.message.startswith("this worker has only 1 CUDA device (cuda:0),")


def test_no_local_cuda_devices():
    for local in ([], ["cpu"]):
        problems = DeviceMap.parse("1_0_0", me="worker0").validate(local)
        expected = dmod.LOCAL_NO_CUDA.format(peer="worker1", device="cuda:0", me="worker0")
        assert problems == [Problem("worker1", "cuda:0", expected)]
        assert "this machine has no CUDA devices" in expected


def test_remote_index_beyond_the_peer_device_count():
    problems = DeviceMap.parse("1_0_3").validate(None, {"worker1": ["cuda:0", "cuda:1", "cuda:2"]})
    expected = dmod.REMOTE_TOO_FEW.format(
        peer="worker1", count=3, s="s", available="cuda:0, cuda:1, cuda:2", device="cuda:3"
    )
    assert problems == [Problem("worker1", "cuda:3", expected)]


def test_peer_without_cuda_devices():
    problems = DeviceMap.parse("1_0_0").validate(None, {"worker1": []})
    expected = dmod.REMOTE_NO_CUDA.format(peer="worker1", device="cuda:0")
    assert problems == [Problem("worker1", "cuda:0", expected)]


def test_peers_whose_devices_are_unknown_are_not_checked():
    assert DeviceMap.parse("1_0_7").validate(["cuda:0"], {"worker2": []}) == []


def test_unknown_peer_when_names_are_known():
    dm = DeviceMap.parse({"wroker1": {0: 1}, "worker1": {1: 0}}, names={0: "worker0", 1: "worker1"})
    expected = dmod.UNKNOWN_PEER.format(peer="wroker1", known="worker0, worker1")
    assert dm.validate() == [Problem("wroker1", None, expected)]
    assert DeviceMap.parse("1_0_1").validate() == []  # no names: nothing to compare with


def test_mapping_to_oneself_is_valid_unless_refused():
    dm = DeviceMap.parse({"worker0": {0: 1}}, me="worker0", names={0: "worker0"})
    assert dm.validate() == []
    expected = dmod.SELF_MAP.format(peer="worker0")
    assert dm.validate(allow_self=False) == [Problem("worker0", None, expected)]


def test_a_map_to_oneself_lands_on_this_machine():
    dm = DeviceMap.parse({"worker0": {0: 1}}, me="worker0")
    (problem,) = dm.validate(["cuda:0"])
    assert problem.message == dmod.REMOTE_TOO_FEW.format(
        peer="worker0", count=1, s="", available="cuda:0", device="cuda:1"
    )


def test_every_problem_is_reported_once():
    dm = DeviceMap.parse(
        {"worker1": {0: 1, 2: 1, "gpu0": 0}, "ghost": {0: 0}, "worker2": {0: 5}},
        me="worker0",
        names={0: "worker0", 1: "worker1", 2: "worker2"},
    )
    problems = dm.validate(["cuda:0", "cuda:1"], {"worker2": ["cuda:0"]})
    assert [(p.peer, p.device) for p in problems] == [
        ("worker1", "cuda:2"),  # local index
        ("worker1", "gpu0"),  # invalid
        ("worker1", "cuda:1"),  # duplicated target
        ("ghost", None),  # unknown peer
        ("worker2", "cuda:5"),  # remote index
    ]
    assert len(set(messages(problems))) == len(problems)
    for problem in problems:
        assert problem.peer in problem.message and str(problem) == problem.message


def test_a_device_used_twice_is_reported_once():
    problems = DeviceMap.parse("1_0_1,1_0_2", me="worker0").validate([])
    expected = dmod.LOCAL_NO_CUDA.format(peer="worker1", device="cuda:0", me="worker0")
    assert messages(problems).count(expected) == 1


def test_check_raises_with_every_message():
    dm = DeviceMap.parse("1_0_1,1_0_2,2_5_0", me="worker0")
    problems = dm.validate(["cuda:0"])
    assert len(problems) == 2
    with pytest.raises(ValueError) as info:
        dm.check(["cuda:0"])
    assert str(info.value) == "\n".join(messages(problems))


# -- writing back ---------------------------------------------------------------------------


def test_to_dict_refuses_a_device_mapped_twice():
    with pytest.raises(ValueError) as info:
        DeviceMap.parse("1_0_1,1_0_2").to_dict()
    assert str(info.value) == dmod.DUPLICATED_DEVICE.format(
        device="cuda:0", targets="cuda:1 and cuda:2", peer="worker1"
    )


def test_to_string_writes_ranks_where_known():
    dm = DeviceMap.parse({"worker1": {0: 1}, "learner": {1: 0}, "worker03": {2: 2}})
    assert dm.to_string() == "1_0_1,learner_1_0,worker03_2_2"
    assert dm.to_string({"learner": 7}) == "worker1_0_1,7_1_0,worker03_2_2"
    named = DeviceMap.parse("1_0_1,2_1_0", names={1: "learner", 2: "collector"})
    assert named.to_string() == "1_0_1,2_1_0"


@pytest.mark.parametrize(
    ("spec", "pair"),
    [
        ({"worker1": {"cpu": 0}}, ("worker1", "cpu", "cuda:0")),
        ({"worker1": {0: "cpu"}}, ("worker1", "cuda:0", "cpu")),
        ({"worker1": {-1: 0}}, ("worker1", "cuda:-1", "cuda:0")),
        ({"worker1": {0: "gpu1"}}, ("worker1", "cuda:0", "gpu1")),
    ],
)
def test_to_string_writes_only_cuda_pairs(spec, pair):
    with pytest.raises(ValueError) as info:
        DeviceMap.parse(spec).to_string()
    peer, local, remote = pair
    assert str(info.value) == dmod.CANNOT_WRITE_PAIR.format(peer=peer, local=local, remote=remote)


@pytest.mark.parametrize("peer", ["7", "a,b", " padded"])
def test_to_string_refuses_names_it_could_not_read_back(peer):
    dm = DeviceMap([Pair(peer, "cuda:0", "cuda:1")])
    with pytest.raises(ValueError) as info:
        dm.to_string()
    assert str(info.value) == dmod.CANNOT_WRITE_PEER.format(peer=peer)
    assert dm.to_string({peer: 3}) == "3_0_1"


def test_to_python():
    dm = DeviceMap.parse("1_0_1,1_1_0,2_0_0")
    assert dm.to_python() == (
        "options.set_device_map('worker1', {'cuda:0': 'cuda:1', 'cuda:1': 'cuda:0'})\n"
        "options.set_device_map('worker2', {'cuda:0': 'cuda:0'})\n"
    )
    assert DeviceMap().to_python("opts") == ""
    assert DeviceMap.parse("1_0_1").to_python("opts").startswith("opts.set_device_map(")


def test_repr_evaluates_back():
    namespace = {"DeviceMap": DeviceMap, "Pair": Pair}
    dm = DeviceMap.parse({"worker1": {0: 1, "cpu": "cpu"}}, me="worker0")
    assert repr(dm) == (
        "DeviceMap.parse({'worker1': {'cuda:0': 'cuda:1', 'cpu': 'cpu'}}, me='worker0')"
    )
    assert eval(repr(dm), namespace) == dm
    twice = DeviceMap.parse("1_0_1,1_0_2")  # not a dict: shown as pairs
    assert repr(twice).startswith("DeviceMap([Pair(")
    assert eval(repr(twice), namespace) == twice


def test_pretty_display():
    from IPython.lib.pretty import pretty

    dm = DeviceMap.parse("1_0_1,1_1_0,2_0_0", me="worker0")
    assert pretty(dm) == (
        "DeviceMap for worker0:\n  worker1: cuda:0 -> cuda:1, cuda:1 -> cuda:0\n"
        "  worker2: cuda:0 -> cuda:0"
    )
    assert pretty(DeviceMap()) == "DeviceMap: empty (CPU tensors only)"


# -- torch's own options object -------------------------------------------------------------


def test_apply_sets_the_maps_on_real_options(torch, options):
    dm = DeviceMap.parse({"worker1": {0: 1, 1: 0}, "worker2": {"cpu": 0}})
    dm.apply(options)
    cuda, cpu = (lambda i: torch.device("cuda", i)), torch.device("cpu")
    assert options.device_maps == {
        "worker1": {cuda(0): cuda(1), cuda(1): cuda(0)},
        "worker2": {cpu: cuda(0)},
    }
    assert options.devices == []  # left for torch to derive at init_rpc
    assert DeviceMap.from_torch_options(options) == dm


def test_apply_sets_devices_when_asked(torch, options):
    DeviceMap.parse("1_2_0").apply(options, devices=["cuda:2", 0, " cuda:1"])
    assert options.devices == [torch.device("cuda", i) for i in (0, 1, 2)]


def test_apply_checks_first_and_leaves_options_alone(options):
    with pytest.raises(ValueError) as info:
        DeviceMap.parse({"worker1": {"gpu0": 1}}).apply(options)
    assert str(info.value) == dmod.INVALID_DEVICE.format(
        device="gpu0", peer="worker1", reason=dmod.REASON_UNKNOWN_TYPE
    )
    assert options.device_maps == {}


def test_to_python_does_what_apply_does(options):
    from torch.distributed.rpc import TensorPipeRpcBackendOptions

    dm = DeviceMap.parse({"worker1": {0: 1, "cpu": "cpu"}, "learner": {3: 2}})
    dm.apply(options)
    other = TensorPipeRpcBackendOptions()
    exec(dm.to_python("other"), {"other": other})
    assert other.device_maps == options.device_maps


def test_from_torch_options_reads_maps_set_elsewhere(options):
    options.set_device_map("worker1", {"cuda:0": "cuda:1"})
    options.set_device_map("worker1", {"cuda:1": "cuda:1"})  # torch takes many-to-one here
    dm = DeviceMap.from_torch_options(options, me="worker0")
    assert dm == DeviceMap.parse("1_0_1,1_1_1")
    assert [p.device for p in dm.validate()] == ["cuda:1"]


def test_torch_reads_int_devices_as_its_builds_accelerator(torch, options):
    # Why apply and to_python write "cuda:N" and never N: torch (2.13 and 2.14 here) reads an
    # int device as "the build's accelerator", CUDA or not, with or without a GPU; a CPU
    # build has none and raises. "cuda:N" means the same on every build.
    if torch.backends.cuda.is_built():
        options.set_device_map("worker1", {0: 1})
        assert options.device_maps["worker1"] == {torch.device("cuda:0"): torch.device("cuda:1")}
    elif getattr(torch, "accelerator", None) and torch.accelerator.current_accelerator() is None:
        with pytest.raises(RuntimeError, match="accelerator"):
            options.set_device_map("worker1", {0: 1})
    else:
        pytest.skip(f"torch {torch.__version__} has an accelerator that is not CUDA")


def test_machine_devices_matches_torch(torch):
    assert dmod.machine_devices() == [f"cuda:{i}" for i in range(torch.cuda.device_count())]


# -- properties -----------------------------------------------------------------------------

peer_names = st.one_of(
    st.integers(0, 40).map(lambda rank: f"worker{rank}"),
    st.from_regex(r"[a-z][a-z0-9_]{0,8}", fullmatch=True),
)


@st.composite
def valid_maps(draw: st.DrawFn) -> DeviceMap:
    pairs = []
    for peer in draw(st.lists(peer_names, unique=True, max_size=4)):
        indices = st.tuples(st.integers(0, 15), st.integers(0, 15))
        entries = draw(st.lists(indices, unique_by=(lambda t: t[0], lambda t: t[1]), max_size=4))
        pairs += [Pair(peer, f"cuda:{a}", f"cuda:{b}") for a, b in entries]
    return DeviceMap(pairs)


@FAST
@given(valid_maps())
def test_valid_maps_survive_the_string_form(dm):
    text = dm.to_string()
    assert DeviceMap.parse(text) == dm
    assert DeviceMap.parse(text).to_string() == text  # string -> map -> string
    assert DeviceMap.parse(dm.to_dict()) == dm  # dict -> map -> dict
    assert DeviceMap.parse(DeviceMap.parse(dm.to_dict()).to_string()).to_dict() == dm.to_dict()
    assert dm.validate() == []


@FAST
@given(valid_maps(), st.data())
def test_valid_maps_survive_the_string_form_with_names(dm, data):
    ranks = data.draw(st.permutations(range(len(dm.peers))))
    names = dict(zip(ranks, dm.peers, strict=True))
    text = DeviceMap(dm.pairs, names=names).to_string()
    assert all(item.split("_")[0].isdigit() for item in text.split(",") if item)
    assert DeviceMap.parse(text, names=names) == dm


garbage_text = st.one_of(st.text(), st.text(alphabet="0123456789_,- \t:cudapwrkeo.x"))


def assert_keeps_its_promises(dm: DeviceMap) -> None:
    """What is true of any map ``parse`` returns: named peers, devices as TensorPipe spells
    them or as written, problems listed (never raised), and its dict and string forms read
    back as the same map wherever they can be written; the dict form cannot be written
    exactly when one device is mapped to two targets for one peer, which validate says."""
    for pair in dm:
        assert pair.peer and pair.peer == pair.peer.strip(), pair
        for device in (pair.local, pair.remote):
            assert device == device.strip().lower(), pair
            assert not dmod._INDEX.fullmatch(device), pair  # a bare index became cuda:N
    problems = dm.validate()
    assert all(isinstance(p, Problem) and p.message and p.peer in dm.peers for p in problems)
    assert DeviceMap.parse(dm) == dm
    duplicated = [p for p in problems if p.message.startswith("duplicated device:")]
    try:
        as_dict = dm.to_dict()
    except ValueError:
        assert duplicated, dm
    else:
        assert not duplicated, dm
        assert DeviceMap.parse(as_dict) == dm and DeviceMap.parse(as_dict).to_dict() == as_dict
    try:
        text = dm.to_string()
    except ValueError:
        return
    assert DeviceMap.parse(text) == dm, text


@FAST
@given(garbage_text)
def test_garbage_strings_raise_only_value_error(text):
    try:
        dm = DeviceMap.parse(text)
    except ValueError:
        return
    assert_keeps_its_promises(dm)


scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 20), st.floats(), garbage_text, st.just("cpu")
)


def mostly(good: st.SearchStrategy, bad: st.SearchStrategy, one_in: int = 10) -> st.SearchStrategy:
    """``good``, and ``bad`` one draw in ``one_in``: one bad value fails a whole map."""
    return st.integers(1, one_in).flatmap(lambda k: bad if k == 1 else good)


# peers and devices as a user may write them, well or badly, among any scalars: enough of
# the dicts parse that what a parsed map promises is checked, not only that nothing but
# ValueError comes out
any_peer = mostly(st.one_of(st.integers(0, 40), peer_names, st.just(" worker1 ")), scalars)
any_device = mostly(st.one_of(
    st.integers(-1, 15), st.integers(-1, 15).map(lambda i: f"cuda:{i}"),
    st.sampled_from(["cpu", " CUDA:1 ", "gpu0", "cuda", "cuda:x", "007", "-2", "worker1"]),
    garbage_text), scalars)

garbage_dicts = st.dictionaries(
    any_peer, mostly(st.dictionaries(any_device, any_device, max_size=4), scalars), max_size=4)


@FAST
@given(garbage_dicts)
def test_garbage_dicts_raise_only_value_error(spec):
    try:
        dm = DeviceMap.parse(spec)
    except ValueError:
        return
    assert len(dm) <= sum(len(device_map) for device_map in spec.values())
    assert_keeps_its_promises(dm)


@FAST
@given(
    st.lists(st.builds(Pair, garbage_text, garbage_text, garbage_text), max_size=8),
    st.one_of(st.none(), garbage_text),
    st.one_of(st.none(), st.dictionaries(st.integers(0, 5), garbage_text)),
    st.one_of(st.none(), st.lists(st.one_of(garbage_text, st.integers(-2, 4)))),
    st.one_of(st.none(), st.dictionaries(garbage_text, st.lists(garbage_text))),
    st.booleans(),
)
def test_validate_never_raises(pairs, me, names, local, remote, allow_self):
    dm = DeviceMap(pairs, me=me, names=names)
    problems = dm.validate(local, remote, allow_self=allow_self)
    assert all(isinstance(problem, Problem) and problem.message for problem in problems)


devices_or_cpu = st.one_of(st.just("cpu"), st.integers(0, 4).map(lambda i: f"cuda:{i}"))


@FAST
@given(
    st.dictionaries(
        st.sampled_from(["worker0", "worker1", "worker2"]),
        st.dictionaries(devices_or_cpu, devices_or_cpu, max_size=4),
        max_size=3,
    ),
    st.lists(st.integers(0, 3), min_size=3, max_size=3),
)
def test_validate_agrees_with_torch(torch, spec, counts):
    from torch.distributed.rpc.backend_registry import _validate_device_maps

    names = ["worker0", "worker1", "worker2"]
    count = dict(zip(names, counts, strict=True))
    torch_maps = {name: {} for name in names}
    torch_maps["worker0"] = {
        peer: {torch.device(k): torch.device(v) for k, v in device_map.items()}
        for peer, device_map in spec.items()
    }
    try:
        _validate_device_maps(names, count, torch_maps, {n: [] for n in names}, False)
        torch_ok = True
    except ValueError:
        torch_ok = False
    dm = DeviceMap.parse(spec, me="worker0")
    devices = {name: [f"cuda:{i}" for i in range(count[name])] for name in names}
    assert (dm.validate(devices["worker0"], devices) == []) == torch_ok
