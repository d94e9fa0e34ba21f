"""What a worker writes, seen in the notebook as if the cell ran there: progress bars that
move while the cell runs, one region per worker, in few messages, nothing lost or late."""

from __future__ import annotations

import re

TQDM_CELL = (
    "from tqdm import tqdm\nimport time\n"
    "for i in tqdm(range(30), mininterval=0.05):\n    time.sleep(0.1)\n"
    "print('done')\n"
)


def regions(out) -> dict[str, list[tuple[float, str]]]:
    """Each display region (display id) of a cell: (arrival time, text) of every version."""
    found: dict[str, list[tuple[float, str]]] = {}
    for t, kind, content in out.events:
        if kind in ("display_data", "update_display_data"):
            did = content.get("transient", {}).get("display_id")
            if did:
                found.setdefault(did, []).append((t, content["data"].get("text/plain", "")))
    return found


def percent(text: str) -> int:
    m = re.search(r"(\d+)%", text)
    return int(m.group(1)) if m else -1


def test_two_workers_bars_are_two_moving_lines(group):
    out = group.execute("%%remote --all\n" + TQDM_CELL, timeout=60)
    bars = regions(out)
    names = sorted(versions[0][1].split("]")[0] + "]" for versions in bars.values())
    assert names == ["[worker1]", "[worker2]"], bars
    for versions in bars.values():
        owner = versions[0][1].split("]")[0] + "]"
        assert all(v.startswith(owner) for _, v in versions)  # a region is one worker's
        assert "\r" not in "".join(v for _, v in versions)
        shown = [percent(v) for _, v in versions]
        assert shown == sorted(shown), shown  # it only moves forward
        assert len(set(shown)) >= 5, shown  # and it moved, several times
        assert "100%" in versions[-1][1] and "30/30" in versions[-1][1]
        # live: the bar was there well before the cell ended (the loop takes 3 s)
        assert out.finished - versions[0][0] > 1.5, (out.finished - versions[0][0])
    # the ended lines are each worker's, whole and marked
    assert sorted(out.stdout.splitlines()) == ["[worker1] done", "[worker2] done"]
    assert "\r" not in out.stderr
    # coalesced: a 3 s bar on two workers is tens of messages, not hundreds
    assert out.messages < 150, out.messages


def test_one_worker_bar_arrives_while_it_runs(group):
    out = group.execute("%%remote worker1\n" + TQDM_CELL, timeout=60)
    writes = [(t, text) for t, kind, text in out.events if kind == "stderr"]
    assert "30/30" in out.stderr and "100%" in out.stderr
    early = [t for t, text in writes if out.finished - t > 1.5]
    assert early, "nothing of the bar arrived before the cell's end"
    assert len(writes) < 80, len(writes)  # tens of messages for 3 s
    assert out.stdout == "done\n"


def test_partial_lines_are_kept_and_stay_in_their_cell(group):
    out = group.execute("%%remote --all\nimport sys\nprint('a', end='')\n"
                        "sys.stdout.write('\\rb')\nsys.stdout.flush()", timeout=60)
    # the line a worker left open is shown at the cell's end, as a terminal shows it
    shown = {v[-1][1] for v in regions(out).values()}
    assert shown == {"[worker1] b", "[worker2] b"}, (regions(out), out.stdout)
    after = group.execute("print('next')")
    assert after.stdout == "next\n" and not after.displays


def test_a_thread_the_cell_started_is_heard_when_the_cell_itself_prints_nothing(group):
    """A cell's output is captured from its first write, whichever of its threads makes it:
    a thread it started, while the cell's own thread writes nothing (or only later)."""
    out = group.execute("%%remote --all\nimport threading\n"
                        "t = threading.Thread(target=print, args=('from its thread',))\n"
                        "t.start()\nt.join()", timeout=60)
    assert sorted(out.stdout.splitlines()) == ["[worker1] from its thread",
                                               "[worker2] from its thread"], out.stdout
    out = group.execute("%%remote worker1\nimport threading\n"
                        "t = threading.Thread(target=print, args=('first',))\n"
                        "t.start()\nt.join()\nprint('then the cell')", timeout=60)
    assert out.stdout == "first\nthen the cell\n", out.stdout
    # the next cell starts with nothing of these
    assert group.execute("%%remote worker1\n1 + 1").stdout == ""


def test_background_cell_bars_reach_the_cell_that_started_it(group):
    bg = group.execute("%%remote --all --bg\n" + TQDM_CELL.replace("0.1", "0.05"), timeout=30)
    group.execute("1 + 1")  # another cell runs meanwhile
    msgs = group.later(bg.msg_id, timeout=30, until=lambda ms: sum(
        "30/30" in str(m["content"].get("data", {}).get("text/plain", "")) for m in ms) >= 2)
    texts = [m["content"]["data"]["text/plain"] for m in msgs
             if m["msg_type"] in ("display_data", "update_display_data")
             and m["content"].get("transient", {}).get("display_id")]
    done = {t.split("]")[0] + "]" for t in texts if "30/30" in t}
    assert done == {"[worker1]", "[worker2]"}, texts


def test_local_runs_the_cell_on_the_workers_and_in_the_notebook(group):
    out = group.execute("%%remote --all --local --fetch\nimport os\nx = 21\n"
                        "print('pid', os.getpid())\nx * 2")
    assert out.text == "{'worker1': 42, 'worker2': 42, 'local': 42}"
    assert group.value("x") == 21  # the notebook has the cell's definitions too
    lines = out.stdout.splitlines()
    assert f"pid {group.pid}" in lines  # the notebook's own run, printed as its own
    assert sorted(ln.split()[0] for ln in lines if ln.startswith("[")) == ["[worker1]", "[worker2]"]

    one = group.execute("%%remote worker1 --local\nx + 1")
    assert one.text.startswith("{'worker1': RRef on worker1") and one.text.endswith("'local': 22}"), one.text


def test_local_failures_name_where_they_happened(group):
    out = group.execute("%%remote worker1 --local\nimport os\n"
                        "1 / (os.getpid() != __import__('rpcnb').group().members[0].pid)",
                        allow_error=True)
    # only the notebook divides by zero (worker0 is the notebook itself)
    assert out.error is not None and "local" in out.traceback, out.traceback
    assert "ZeroDivisionError" in out.traceback and "worker1" not in out.error["evalue"]
    assert group.execute("%%remote worker1 --fetch --local\n5").text == \
        "{'worker1': 5, 'local': 5}"


def test_local_with_bg_is_refused(group):
    out = group.execute("%%remote worker1 --bg --local\n1", allow_error=True)
    assert "--local runs the cell in the notebook too" in out.stderr


def test_a_joined_kernels_bar_is_a_line_of_its_own(rpcnb_kernel, kernel_factory):
    lead, bob = rpcnb_kernel, kernel_factory()
    started = lead.execute("%rpc_init --workers 1")
    join = next(ln.strip() for ln in started.stdout.splitlines()
                if ln.strip().startswith("%rpc_init --join")).replace("NAME", "bob")
    bob.execute("%load_ext rpcnb")
    bob.execute(join)
    out = lead.execute("%%remote worker1,bob\n" + TQDM_CELL, timeout=60)
    bars = regions(out)
    assert sorted(v[0][1].split("]")[0] + "]" for v in bars.values()) == ["[bob]", "[worker1]"]
    for versions in bars.values():
        assert len({percent(v) for _, v in versions}) >= 5  # it moved
        assert "30/30" in versions[-1][1]
    assert sorted(out.stdout.splitlines()) == ["[bob] done", "[worker1] done"]
    lead.execute("%rpc_shutdown", timeout=60)
