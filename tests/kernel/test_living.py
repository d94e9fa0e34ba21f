"""Living in the notebook (issue 18), in real kernels with real workers: background cells
that keep printing into the cell that started them, queueing and cancelling, timeouts
that say what happened, restarting one worker, adding workers, and progress displays.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
from conftest import pid_alive, worker_pids

LOOP = """\
import time
for i in range({n}):
    print('tick', i, flush=True)
    time.sleep({pause})
{value}
"""


def texts(messages: list[dict]) -> str:
    return "".join(m["content"].get("text", "") for m in messages
                   if m["msg_type"] == "stream")


def shown(out) -> str:
    """Every text/plain a cell displayed (display_data and its updates)."""
    return "\n".join(d.get("data", {}).get("text/plain", "") for d in out.displays)


def test_rpc_jobs_with_an_id_shows_that_cell_and_how_it_ended(group):
    group.execute("%%remote worker1 --bg -o failing\nimport time\ntime.sleep(0.2)\nundefined_name")
    job = group.value("failing.id")
    assert group.value("failing.wait(30)") is True
    assert group.value("failing.status") == "failed: NameError"  # what the cell raised
    shown = group.execute(f"%rpc_jobs {job}").stdout
    assert f"[{job}]" in shown and "failed: NameError" in shown, shown
    assert "name 'undefined_name' is not defined" in shown and "undefined_name" in shown, shown
    group.execute("%%remote worker1 --bg -o fine --fetch\n6 * 7")
    assert group.value("fine.wait(30)") is True
    assert f"[{job + 1}] ended: 42" in group.execute(f"%rpc_jobs {job + 1}").stdout
    out = group.execute("%rpc_jobs 999", allow_error=True)
    assert "No background cell [999] in this kernel" in out.traceback + out.stderr, out.stderr


@pytest.mark.serial  # a background cell returns within 3 s
def test_a_background_cell_streams_into_its_cell_while_other_cells_run(group):
    t0 = time.monotonic()
    bg = group.execute("%%remote worker1 --bg -o h\n" + LOOP.format(n=8, pause=0.4, value=42))
    assert time.monotonic() - t0 < 3  # returned at once, not after 3.2 s of ticks
    job = group.value("h.id")
    assert f"background cell [{job}] on worker1" in bg.stdout + bg.text
    # other cells run meanwhile: in the notebook, and on another worker
    t1 = time.monotonic()
    other = group.execute("%%remote worker2 --fetch\n6 * 7")
    assert other.text == "42"
    assert time.monotonic() - t1 < 2.5
    jobs = group.execute("%rpc_jobs")
    assert f"[{job}]" in jobs.text and "worker1" in jobs.text and "running" in jobs.text
    # the ticks keep arriving in the cell that started it, after that cell finished
    msgs = group.later(bg.msg_id, until=lambda ms: "tick 7" in texts(ms), timeout=30)
    later = texts(msgs)
    assert "tick 7" in later, later
    ticks = [int(line.split()[1]) for line in (bg.stdout + later).splitlines()
             if line.startswith("tick")]
    assert ticks == list(range(8))
    assert group.value("(h.wait(20), h.ready(), h.status)") == (True, True, "done")
    assert group.value("h.result().to_here()") == 42
    assert "No background cells" in group.execute("%rpc_jobs").text
    assert "done" in group.execute("%rpc_jobs --all").text


def test_later_cells_on_the_same_worker_queue_behind_it_and_say_so(group):
    group.execute("%%remote worker1 --bg -o first\nimport time\ntime.sleep(3)\n'first'")
    group.execute("%%remote worker1 --bg -o second\nfrom_second = 'ran'\n'second'")
    one, two = group.value("(first.id, second.id)")
    status = group.value("second.status")
    assert status.startswith(f"queued behind [{one}] on worker1"), status
    t0 = time.monotonic()
    fg = group.execute("%%remote worker1 --fetch\nfrom_second")
    assert f"waits until the background cells running on worker1 ([{one}], [{two}])" in fg.stderr
    assert fg.text == "'ran'"  # it ran after both, in order
    assert group.value("(first.ready(), second.ready())") == (True, True)
    assert time.monotonic() - t0 > 1.0
    assert group.value("second.result().to_here()") == "second"


def test_cancel_stops_a_running_cell_and_drops_a_queued_one(group):
    bg = group.execute("%%remote worker1 --bg -o h\n" + LOOP.format(n=1000, pause=0.1, value=1))
    group.execute("%%remote worker1 --bg -o queued\nnever = True")
    # it runs: its first ticks have reached the notebook
    assert "tick 1" in texts(group.later(bg.msg_id, until=lambda ms: "tick 1" in texts(ms)))
    assert group.value("(h.status, queued.status.split(' behind')[0])") == ("running", "queued")
    assert group.value("(queued.cancel(), h.cancel())") == (True, True)
    assert group.value("(h.wait(10), queued.wait(10))") == (True, True)
    assert group.value("(h.status, queued.status)") == ("cancelled", "cancelled")
    err = group.execute("h.result()", allow_error=True)
    assert "Cancelled" in err.traceback and "cancelled" in err.traceback
    # the worker and its namespace are still there; the queued cell never ran
    assert group.execute("%remote --fetch worker1 i > 0").text == "True"
    assert group.execute("%remote --fetch worker1 'never' in globals()").text == "False"
    assert group.value("h.cancel()") is False  # it has ended


def test_wait_interactive_shows_progress_then_gives_the_result(group):
    group.execute("%%remote worker1,worker2 --bg -o h\nimport time\ntime.sleep(1.5)\n3")
    out = group.execute("r = h.wait_interactive(interval=0.2)\nsorted(r)")
    # a tqdm.auto bar: in a notebook a widget, whose model counts the workers done
    bars = [m for m in out.comms if m["msg_type"] == "comm_open"
            and m["content"]["data"]["state"].get("_model_name") in ("FloatProgressModel",
                                                                      "IntProgressModel")]
    assert len(bars) == 1 and bars[0]["content"]["data"]["state"]["max"] == 2, out.comms
    values = [m["content"]["data"]["state"]["value"] for m in out.comms
              if m["msg_type"] == "comm_msg" and m["content"]["comm_id"] ==
              bars[0]["content"]["comm_id"] and "value" in m["content"]["data"]["state"]]
    assert values and values[-1] == 2, values
    labels = " ".join(str(m["content"]["data"]["state"].get("value", "")) for m in out.comms
                      if m["msg_type"] in ("comm_open", "comm_msg"))
    assert "workers done" in labels and "2/2" in labels, labels
    assert out.text == "['worker1', 'worker2']"


def test_a_timeout_says_whether_the_worker_stopped_or_still_runs(own_group):
    out = own_group.execute("%%remote worker1 --timeout 1\nimport time\ntime.sleep(30)",
                        allow_error=True)
    assert "did not finish within 1 s and was interrupted" in out.traceback
    # a cell that ignores interrupts keeps running: the message says so, and what to do
    out = own_group.execute(
        "%%remote worker1 --timeout 1\nimport signal, time\n"
        "signal.signal(signal.SIGINT, signal.SIG_IGN)\ntime.sleep(600)", allow_error=True)
    assert "is still running there" in out.traceback, out.traceback
    assert "%rpc_restart worker1" in out.traceback
    old = worker_pids(own_group)["worker1"]
    restarted = own_group.execute("%rpc_restart worker1")
    assert f"worker1 was running (pid {old})" in restarted.stdout
    assert "namespace starts empty" in restarted.stdout
    assert not pid_alive(old)
    assert own_group.execute("%remote --fetch worker1 1 + 1").text == "2"


def test_restart_replaces_a_killed_worker_and_names_the_rrefs_lost(own_group):
    own_group.execute("%%remote worker1\nstate = 'set up'")
    own_group.execute("r = %remote worker1 [1, 2, 3]")
    old = worker_pids(own_group)["worker1"]
    os.kill(old, signal.SIGKILL)
    err = own_group.execute("%remote --fetch worker1 1", allow_error=True)
    deadline = time.monotonic() + 10
    while "died" not in err.traceback and time.monotonic() < deadline:
        time.sleep(0.2)
        err = own_group.execute("%remote --fetch worker1 1", allow_error=True)
    assert "died" in err.traceback
    out = own_group.execute("%rpc_restart worker1")
    assert f"worker1 was dead (killed by SIGKILL) (pid {old})" in out.stdout
    assert "The RRefs worker1 owned are lost; in this notebook: r." in out.stdout
    new = worker_pids(own_group)["worker1"]
    assert new != old and pid_alive(new)
    members = own_group.execute("%rpc_workers").text
    assert "no:" not in members  # every member alive again
    missing = own_group.execute("%remote --fetch worker1 state", allow_error=True)
    assert "NameError" in missing.traceback  # its namespace started empty
    # the other members reach it again, through rpcnb and through torch
    got = own_group.execute(
        "%%remote worker2 --fetch\nimport operator\nimport torch.distributed.rpc as rpc\n"
        "rpc.rpc_sync('worker1', operator.add, (40, 2))")
    assert got.text == "42"


def test_restart_and_add_refuse_what_they_cannot_do(group):
    err = group.execute("%rpc_restart worker0", allow_error=True)
    assert "is this kernel" in err.traceback
    err = group.execute("%rpc_restart worker9", allow_error=True)
    assert "no worker 'worker9'" in err.traceback
    err = group.execute("%rpc_init --add 0", allow_error=True)
    assert "--add takes how many workers" in err.traceback
    err = group.execute("%rpc_init --add 1 --workers 2", allow_error=True)
    assert "--add N goes alone" in err.traceback


def test_add_starts_more_workers_in_a_running_group(own_group):
    out = own_group.execute("%rpc_init --add 2")
    assert "added 2 worker(s): worker3, worker4" in out.stdout
    names = set(worker_pids(own_group))
    assert names == {"worker0", "worker1", "worker2", "worker3", "worker4"}
    assert own_group.execute("%remote --fetch worker4 2 + 2").text == "4"
    got = own_group.execute("%remote --all --fetch 1")
    assert "worker4" in got.text and "worker1" in got.text


def test_init_shows_each_worker_starting(rpcnb_kernel):
    out = rpcnb_kernel.execute("%rpc_init --workers 2")
    text = shown(out)
    assert "starting (pid" in text and "ready" in text, text
    assert "worker1" in text and "worker2" in text
    assert "2 worker(s) started in" in text  # the board ends as one line


@pytest.mark.serial  # a 114 MB push on one host shows no bar: it takes under 0.5 s
def test_large_push_and_fetch_show_progress(group):
    group.execute("import torch\nbig = torch.ones(30_000_000)")  # 120 MB
    # on one host it takes milliseconds: no bar (it shows after RPCNB_PROGRESS_DELAY s);
    # the first push makes the shared-memory buffers on both sides (and frees its own)
    group.execute("%%remote worker1 --push big\ndel big")
    quick = group.execute("%%remote worker1 --push big\nfloat(big.sum())")
    assert "--push to worker1" not in shown(quick), shown(quick)
    group.execute("import os\nos.environ['RPCNB_PROGRESS_DELAY'] = '0'")  # at once
    out = group.execute("%%remote worker1 --push big\nfloat(big.sum())")
    text = shown(out)
    assert "--push to worker1: 114.4 MB" in text, text
    assert "/s" in text  # the last update says the rate
    out = group.execute("%%remote worker1 --fetch\nbig * 2")
    text = shown(out)
    assert "--fetch from worker1: 114.4 MB" in text, text
    small = group.execute("%%remote worker1 --fetch\nbig[:10]")
    assert not small.displays  # small values show no bar
    group.execute("del os.environ['RPCNB_PROGRESS_DELAY']")


def test_probe_shows_a_progress_bar(group):
    out = group.execute("p = %rpc_probe worker1 --sizes 1K,1M --repeats 1")
    widgets = [d for d in out.displays
               if "application/vnd.jupyter.widget-view+json" in d.get("data", {})]
    assert widgets, out.displays
