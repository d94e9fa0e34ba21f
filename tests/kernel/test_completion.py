"""Tab and Shift-Tab in a ``%%remote`` cell (rpcnb/frontend/completion.py, rpcnb/observe/names.py),
asked of a real kernel as a notebook asks it (``complete_request``, ``inspect_request``):
names and attributes come from the worker's namespace, not the kernel's; Shift-Tab shows the
worker's object; a worker that holds the GIL leaves the notebook's own completion within
0.5 s; the magic's line completes worker names and flags; a plain cell completes as it did
without rpcnb; and ``%rpc_who`` (and the panel's "variables") lists a worker's variables."""

from __future__ import annotations

import os
import re
import time
import uuid
from queue import Empty
from typing import Any

import pytest

from rpcnb import errors
from rpcnb.frontend import panel
from rpcnb.observe import names


def reply_to(kernel, msg_id: str, timeout: float = 30) -> dict[str, Any]:
    """The shell reply to the request ``msg_id``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            msg = kernel.kc.get_shell_msg(timeout=0.2)
        except Empty:
            continue
        if msg["parent_header"].get("msg_id") == msg_id:
            return msg["content"]
    raise AssertionError(f"no reply in {timeout} s")


def complete(kernel, code: str, cursor: int | None = None) -> dict[str, Any]:
    return reply_to(kernel, kernel.kc.complete(code, len(code) if cursor is None else cursor))


def inspect(kernel, code: str, cursor: int | None = None) -> dict[str, Any]:
    return reply_to(kernel, kernel.kc.inspect(code, len(code) if cursor is None else cursor))


def completed(code: str, reply: dict[str, Any]) -> list[str]:
    """Each match put in place, as the front end does: the text before the cursor."""
    return [code[:reply["cursor_start"]] + m for m in reply["matches"]]


def shape(reply: dict[str, Any]) -> tuple[Any, ...]:
    """A completion reply but the types of its matches."""
    return (reply["status"], reply["matches"], reply["cursor_start"], reply["cursor_end"],
            [(t["start"], t["end"], t["text"]) for t in
             reply["metadata"].get("_jupyter_types_experimental", [])])


def plain(text: str) -> str:
    return re.sub(r"\x1b\[[0-9;]*m", "", text)


def test_a_name_only_the_worker_has_completes_and_one_only_the_kernel_has_does_not(group):
    group.execute("%%remote worker1\nworker_only_count = 1")
    group.execute("kernel_only_count = 2")
    code = "%%remote worker1\nx = 1\nworker_only_c"
    reply = complete(group, code)
    assert reply["status"] == "ok"
    assert reply["metadata"]["rpcnb"]["member"] == "worker1"
    assert reply["metadata"]["rpcnb"]["answered"] is True
    assert code[:-len("worker_only_c")] + "worker_only_count" in completed(code, reply)
    assert reply["cursor_end"] == len(code)  # the whole cell's coordinates
    types = {t["text"]: t["type"] for t in reply["metadata"]["_jupyter_types_experimental"]}
    assert "worker_only_count" in types
    reply = complete(group, "%%remote worker1\nkernel_only_c")
    assert reply["metadata"]["rpcnb"]["answered"] is True
    assert reply["matches"] == []
    # several targets: the first one's namespace; --all: the first worker's
    group.execute("%%remote worker2\nworker2_only_count = 3")
    for line in ("worker2,worker1", "worker2 --fetch"):
        reply = complete(group, f"%%remote {line}\nworker2_only_c")
        assert reply["metadata"]["rpcnb"]["member"] == "worker2"
        assert "worker2_only_count" in reply["matches"]
    reply = complete(group, "%%remote --all\nworker_only_c")
    assert reply["metadata"]["rpcnb"]["member"] == "worker1"
    assert "worker_only_count" in reply["matches"]


def test_attributes_of_a_remote_tensor_complete(group):
    group.execute("%%remote worker1\nimport torch\nw = torch.zeros(2)")
    assert group.value("'w' in globals()") is False
    code = "%%remote worker1\nw.ab"
    reply = complete(group, code)
    assert reply["metadata"]["rpcnb"]["answered"] is True
    done = completed(code, reply)
    assert code[:-2] + "abs" in [d.replace("w..", "w.") for d in done], done
    assert reply["cursor_end"] == len(code)
    # the cursor in the middle of the body: the text after it stays out of the request
    code = "%%remote worker1\nw.ab\nprint(1)"
    reply = complete(group, code, code.index("\nprint"))
    assert reply["cursor_end"] == code.index("\nprint")
    assert any(m.lstrip(".") == "abs" for m in reply["matches"])


def test_shift_tab_shows_the_workers_object(group):
    group.execute('''%%remote worker1
def scale(x, factor=2):
    """Multiply x by factor, on the worker."""
    return x * factor
''')
    group.execute('def scale(y):\n    "The kernel\'s own scale."\n    return y')
    code = "%%remote worker1\nscale(3)"
    reply = inspect(group, code, code.index("scale") + 3)
    assert reply["status"] == "ok" and reply["found"] is True
    assert reply["metadata"]["rpcnb"]["answered"] is True
    text = plain(reply["data"]["text/plain"])
    assert "Multiply x by factor, on the worker." in text
    assert "scale(x, factor=2)" in text
    assert "function" in text
    assert "kernel's own" not in text
    # a worker's tensor: its type; a name the worker lacks: not found (not the kernel's)
    group.execute("%%remote worker1\nimport torch\nw = torch.zeros(2)")
    reply = inspect(group, "%%remote worker1\nw")
    assert reply["found"] is True and "Tensor" in plain(reply["data"]["text/plain"])
    group.execute("kernel_only_thing = 5")
    reply = inspect(group, "%%remote worker1\nkernel_only_thing")
    assert reply["found"] is False and reply["metadata"]["rpcnb"]["answered"] is True


def test_worker_names_and_flags_complete_on_the_magics_line(group):
    reply = complete(group, "%%remote ")
    assert reply["matches"][:2] == ["worker1", "worker2"]
    assert "worker0" not in reply["matches"]  # this kernel
    assert {"--fetch", "--bg", "--all", "-o", "--push"} <= set(reply["matches"])
    reply = complete(group, "%%remote worker1,w\nx = 1", len("%%remote worker1,w"))
    assert reply["matches"] == ["worker2"]
    assert reply["cursor_start"] == len("%%remote worker1,")
    reply = complete(group, "%%remote worker1 --f")
    assert reply["matches"] == ["--fetch"]
    assert reply["cursor_start"] == len("%%remote worker1 ")
    reply = complete(group, "%%remote worker1 ")
    assert "--all" not in reply["matches"] and "--timeout" in reply["matches"]
    reply = complete(group, "y = 1\n%remote --b")
    assert reply["matches"] == ["--bg"]
    reply = complete(group, "%remote wor")
    assert reply["matches"] == ["worker1", "worker2"]


def test_a_plain_cell_completes_as_it_did_without_rpcnb(kernel):
    kernel.execute("plain_value_one = 1\nplain_value_two = 2")
    cells = ["plain_val", "x = plain_value_one\nplain_value_t", "%%remote worker1\nplain_val",
             "import o"]
    before = [complete(kernel, c) for c in cells]
    kernel.execute("%load_ext rpcnb")
    assert kernel.value("'do_complete' in vars(get_ipython().kernel)") is True
    after = [complete(kernel, c) for c in cells]
    # no group: a %%remote cell is the kernel's own completion too (Jedi's types aside:
    # it computes them within a time budget, so one may be "<unknown>" in either)
    for b, a in zip(before, after, strict=True):
        assert "rpcnb" not in a["metadata"]
        assert shape(a) == shape(b)
    assert "plain_value_one" in after[0]["matches"]
    kernel.execute("%unload_ext rpcnb")
    assert kernel.value("'do_complete' in vars(get_ipython().kernel) or "
                        "'do_inspect' in vars(get_ipython().kernel)") is False
    assert kernel.value("len(get_ipython().Completer.custom_matchers)") == 0


def test_a_plain_cell_in_a_group_completes_from_the_kernel(group):
    group.execute("kernel_only_count = 2")
    reply = complete(group, "kernel_only_c")
    assert "kernel_only_count" in reply["matches"]
    assert "rpcnb" not in reply["metadata"]


def displayed(k, out, text: str) -> None:
    """Wait until the background cell ``out`` started has displayed ``text``: in the
    starting cell's own output (it may come before that cell ends), else after it."""
    if any(text in str(d) for d in out.displays):
        return
    got = k.later(out.msg_id, lambda msgs: any(text in str(m["content"]) for m in msgs))
    assert any(text in str(m["content"]) for m in got), (text, out.displays, got)


def test_a_worker_that_waits_in_a_cell_still_completes(group):
    group.execute("%%remote worker1\nworker_only_count = 1")
    out = group.execute("%%remote worker1 --bg -o sleeper\nimport time\n"
                        "from IPython.display import display\ndisplay('sleeping')\ntime.sleep(120)")
    displayed(group, out, "sleeping")
    reply = complete(group, "%%remote worker1\nworker_only_c")
    assert reply["metadata"]["rpcnb"]["answered"] is True
    assert "worker_only_count" in reply["matches"]
    group.execute("sleeper.cancel()\nassert sleeper.wait(15)")


# worker1's cell blocks in a C call that keeps the GIL (libc's read through ctypes.PyDLL,
# which does not release it) until the test writes a byte to a FIFO: no RPC thread of
# worker1 can run Python meanwhile, however long the kernel takes to ask
HOLD_THE_GIL = """%%remote worker1 --bg -o hog
import ctypes, os
from IPython.display import display
fd = os.open({path!r}, os.O_RDWR)
display('holding the GIL')
ctypes.PyDLL(None).read(fd, ctypes.create_string_buffer(1), 1)
os.close(fd)
"""


@pytest.mark.serial
def test_a_worker_holding_the_gil_falls_back_to_local_completion_within_half_a_second(
        group, tmp_path):
    group.execute("kernel_only_count = 2")
    complete(group, "kernel_only_c")  # the kernel's own completion warmed up
    idle_round_trip = float("inf")
    for _ in range(3):  # the first builds worker1's completer
        t0 = time.perf_counter()
        local = complete(group, "%%remote worker1\nkernel_only_c")
        idle_round_trip = min(idle_round_trip, time.perf_counter() - t0)
        assert local["metadata"]["rpcnb"]["answered"] is True and local["matches"] == []
    fifo = tmp_path / "release"
    os.mkfifo(fifo)
    out = group.execute(HOLD_THE_GIL.format(path=str(fifo)))
    try:
        displayed(group, out, "holding the GIL")
        t0 = time.perf_counter()
        reply = complete(group, "%%remote worker1\nkernel_only_c")
        busy_round_trip = time.perf_counter() - t0
        # Shift-Tab says worker1 did not answer: the kernel's object would be another one
        shown = inspect(group, "%%remote worker1\nkernel_only_count")
    finally:
        with open(fifo, "wb") as release:
            release.write(b"x")
    note = reply["metadata"]["rpcnb"]
    assert note["answered"] is False, note
    assert "kernel_only_count" in reply["matches"]  # the notebook's own completion
    # it gave up on worker1 after 0.5 s, then completed as the kernel does
    assert names.ASK_S - 0.05 <= note["waited"] <= names.ASK_S + 0.1, note
    assert busy_round_trip < note["seconds"] + 0.5, (busy_round_trip, note)
    print(f"completion round trip: idle worker {idle_round_trip * 1e3:.1f} ms, busy worker "
          f"{busy_round_trip * 1e3:.1f} ms (gave up after {note['waited'] * 1e3:.1f} ms, "
          f"{(note['seconds'] - note['waited']) * 1e3:.1f} ms for the kernel's own)")
    assert shown["metadata"]["rpcnb"]["answered"] is False
    assert shown["data"]["text/plain"] == errors.INSPECT_SILENT.format(
        name="worker1", seconds=names.ASK_S, what="kernel_only_count")
    group.execute("assert hog.wait(30)")
    reply = complete(group, "%%remote worker1\nkernel_only_c")  # worker1 answers again
    assert reply["metadata"]["rpcnb"]["answered"] is True and reply["matches"] == []


def test_rpc_who_lists_each_workers_variables(group):
    group.execute("%%remote worker1\nimport torch\nt = torch.zeros(3, 4, dtype=torch.float16)\n"
                  "n = 5\n_hidden = 1")
    out = group.execute("%rpc_who worker1")
    text = out.text
    assert text.startswith("worker1: 2 variables\n"), text
    row = next(line for line in text.splitlines() if line.startswith("t "))
    assert row.split() == ["t", "torch.Tensor", "(3,", "4)", "float16", "cpu", "24", "B"], row
    assert re.search(r"^n +int", text, re.M)
    for hidden in ("torch", "_hidden", "In ", "Out ", "get_ipython", "exit"):
        assert not re.search(rf"^{hidden}", text, re.M), text
    out = group.execute("%rpc_who")
    assert "worker1: 2 variables" in out.text
    assert f"worker2: {errors.WHO_NONE}" in out.text
    assert "worker0" not in out.text
    out = group.execute("%rpc_who worker7", allow_error=True)
    assert "There is no worker 'worker7'" in out.stderr


def test_the_panel_shows_a_members_variables(group):
    group.execute("%%remote worker2\nimport torch\nv = torch.ones(5, dtype=torch.int64)")
    kc = group.kc
    comm_id = uuid.uuid4().hex
    kc.shell_channel.send(kc.session.msg("comm_open", {
        "comm_id": comm_id, "target_name": panel.TARGET, "data": {"detail": "summary"}}))
    kc.shell_channel.send(kc.session.msg("comm_msg", {"comm_id": comm_id, "data": {
        "type": "action", "action": "who", "id": 7, "member": "worker2"}}))
    deadline = time.monotonic() + 30
    reply = None
    while reply is None and time.monotonic() < deadline:
        try:
            msg = kc.get_iopub_msg(timeout=0.2)
        except Empty:
            continue
        data = msg["content"].get("data") or {}
        if msg["msg_type"] == "comm_msg" and data.get("type") == "reply" and data.get("id") == 7:
            reply = data
    kc.shell_channel.send(kc.session.msg("comm_close", {"comm_id": comm_id, "data": {}}))
    assert reply is not None and reply["ok"], reply
    assert reply["member"] == "worker2"
    assert reply["message"] == "worker2: 1 variable"
    (row,) = reply["variables"]
    assert (row["name"], row["type"], row["shape"], row["dtype"], row["device"], row["nbytes"]) \
        == ("v", "torch.Tensor", [5], "int64", "cpu", 40)
