"""Worker sets (rpcnb.session.workersets): one grammar for naming several members, and
labels in that grammar that name the same members when pasted back as a target."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rpcnb import text
from rpcnb.session import workersets

GROUP = [f"worker{i}" for i in range(0, 65)]


@pytest.mark.parametrize("spec, names", [
    ("worker3", ["worker3"]),
    ("worker1-4", ["worker1", "worker2", "worker3", "worker4"]),
    ("worker1-worker3", ["worker1", "worker2", "worker3"]),
    ("worker2,worker5-7", ["worker2", "worker5", "worker6", "worker7"]),
    ("worker2, worker5-6 ,,worker2", ["worker2", "worker5", "worker6"]),
    ("@node-b", ["worker4", "worker5"]),
])
def test_a_set_names_its_members_in_its_order_each_once(spec, names):
    hosts = {"worker4": "node-b", "worker5": "node-b", "worker1": "node-a"}
    assert workersets.expand(spec, GROUP, hosts) == names


@pytest.mark.parametrize("spec, said", [
    ("worker[1:8]", "'worker[1:8]' is not a worker set: write names (worker3), ranges"),
    ("worker8-2", "'worker8-2' is not a worker set"),
    ("worker60-70", "worker60-70 names worker65-70, which are not in this group (it has "
                    "worker0-64)."),
    ("worker70-72", "worker70-72 names no member of this group (it has worker0-64)."),
    ("@elsewhere", "No member runs on host 'elsewhere' (the group's hosts: node-a)."),
])
def test_a_set_that_names_no_member_says_what_there_is(spec, said):
    with pytest.raises(ValueError) as err:
        workersets.expand(spec, GROUP, {"worker1": "node-a"})
    assert said in str(err.value)


def test_labels_are_short_and_written_in_the_grammar():
    assert text.worker_set(f"worker{i}" for i in range(1, 33)) == "worker1-32"
    assert text.worker_set(["worker2", "worker7", "worker5", "worker6"]) == "worker2,worker5-7"
    assert text.worker_set(["worker1", "worker2"]) == "worker1,worker2"  # two: no range
    assert text.worker_set(["kernel_12", "worker3", "worker1", "worker2"]) == "kernel_12,worker1-3"
    assert text.worker_set([]) == ""


@given(st.sets(st.sampled_from(GROUP), min_size=1))
def test_a_label_pasted_as_a_set_names_the_same_members(members):
    label = text.worker_set(members)
    assert " " not in label  # it pastes as one argument of a magic
    assert set(workersets.expand(label, GROUP)) == members
    assert workersets.is_several(label) == (len(members) > 1)
