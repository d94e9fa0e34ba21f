"""Workers that outlive the kernel (issue 51), in real kernels: a kept group survives a
kernel restart (graceful and ``now=True``) and a SIGKILL of the kernel, a new kernel
attaches and finds the old values and a background loop still going; an idle kept group
ends by itself and leaves nothing; two kernels cannot drive one group; a worker that died
meanwhile is said to have died. The JupyterLab panel's side (rpcnb/frontend/panel.py, over
the kernel's comm as the extension drives it) lists the kept groups also while the kernel
is in none, attaches (the line it adds to the notebook) and ends one; %rpc_doctor has a
finding per kept group. Each test has its own runtime folder (its own registry of kept
groups), and every process it started, the keeper's included, is stopped at its end.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
from conftest import Kernel, Seen, children_of, stopped, wait_until
from test_panel import open_comm, send, snapshot_where, wait_for

from rpcnb import errors
from rpcnb.frontend import panel, panel_actions
from rpcnb.paths import shm
from rpcnb.procs.processes import kill_all, pid_alive


class Kept:
    """Kernels of one user (one runtime folder), and every process they and the keepers
    they start make, stopped at the end."""

    def __init__(self, run: Path) -> None:
        run.mkdir(mode=0o700)
        self.run = run
        self.env = {"RPCNB_RUNTIME_DIR": str(run)}
        self.kernels: list[Kernel] = []
        self.pids = Seen()  # every process of the test's, by pid and start time

    def kernel(self) -> Kernel:
        k = Kernel(env=self.env)
        self.kernels.append(k)
        k.execute("%load_ext rpcnb")
        return k

    def restart(self, k: Kernel, now: bool = False) -> None:
        """Restart ``k`` as the notebook's button does; rpcnb loaded in the new one."""
        self.note(k)
        k.km.restart_kernel(now=now)
        k.kc.wait_for_ready(timeout=60)
        k.pid = k.km.provisioner.pid
        k.known.add(k.pid)
        k.execute("%load_ext rpcnb")

    def records(self) -> list[dict]:
        kept = self.run / "kept"
        return [json.loads((p / "record.json").read_text()) for p in sorted(kept.iterdir())
                if (p / "record.json").exists()] if kept.exists() else []

    def note(self, k: Kernel | None = None) -> None:
        for rec in self.records():
            self.pids.update(p for p in [rec["pid"], *rec["workers"].values()] if p)
            self.pids.update(children_of(rec["pid"]) if rec["pid"] else ())
        if k is not None:
            self.pids.update(children_of(k.pid))

    def close(self) -> list[int]:
        self.note()
        for k in self.kernels:
            self.pids.merge(k.known)
            k.close()
        kill_all(self.pids.alive())
        return stopped(self.pids)


@pytest.fixture
def kept(tmp_path):
    holder = Kept(tmp_path / "run")
    try:
        yield holder
    finally:
        left = holder.close()
        assert not left, f"processes left running: {left}"


def start(k: Kernel, line: str = "%rpc_init --workers 2 --keep 10m") -> dict:
    out = k.execute(line)
    assert "attached to kept group group1" in out.stdout, out.stdout
    return out


@pytest.mark.serial  # the attach is timed
def test_a_restart_keeps_the_workers_and_attach_gives_the_old_value(kept):
    k = kept.kernel()
    start(k)
    k.execute("%%remote worker1\nw = 42\nimport torch\nmodel = torch.nn.Linear(3, 2)")
    before = kept.records()[0]
    listed = k.execute("%rpc_groups").stdout
    assert "group1" in listed and "worker1, worker2" in listed and f"kernel_{k.pid}" in listed
    kept.restart(k)
    assert all(pid_alive(p) for p in before["workers"].values())
    t0 = time.monotonic()
    out = k.execute("%rpc_init --attach")
    assert time.monotonic() - t0 < 5
    assert "attached to kept group group1" in out.stdout and "not kept from the kernel" in out.stdout
    assert k.execute("%%remote worker1 --fetch\nw").text == "42"
    assert k.execute("%%remote worker1 --fetch\ntuple(model.weight.shape)").text == "(2, 3)"
    # the keeper runs no cells: --all is the workers
    assert sorted(k.value("sorted(__import__('rpcnb').run(None, '1', fetch=True))")) == \
        ["worker1", "worker2"]
    # the keeper's record (written each second) names the kernel attached now
    assert wait_until(lambda: kept.records()[0]["attached"] == f"kernel_{k.pid}", 5)
    assert kept.records()[0]["workers"] == before["workers"]
    # %rpc_shutdown in the attached kernel ends the kept group: nothing is left
    k.execute("%rpc_shutdown")
    assert wait_until(lambda: not any(pid_alive(p) for p in [before["pid"],
                                                             *before["workers"].values()]), 15)
    assert kept.records() == [] and not shm.leftovers(before["group_id"])
    assert not Path(before["folder"]).exists()
    assert "No kept groups" in k.execute("%rpc_groups").stdout


def test_restart_now_and_a_killed_kernel_keep_the_group(kept):
    k = kept.kernel()
    start(k)
    k.execute("%%remote worker2\ncounter = 1")
    kept.restart(k, now=True)
    k.execute("%rpc_init --attach group1")
    assert k.execute("%%remote worker2 --fetch\ncounter += 1\ncounter").text == "2"
    # SIGKILL of the kernel (out of memory, say): the group goes on; a new kernel attaches
    kept.note(k)
    os.kill(k.pid, signal.SIGKILL)
    assert wait_until(lambda: not pid_alive(k.pid), 10)
    assert wait_until(lambda: kept.records()[0]["attached"] == "", 15)  # the keeper noticed
    k2 = kept.kernel()
    k2.execute("%rpc_init --attach")
    assert k2.execute("%%remote worker2 --fetch\ncounter").text == "2"
    # torch's all-gather, on the workers and this kernel at once: the keeper, which runs no
    # code of the user's, is not waited for, nor is the kernel that was killed
    got = k2.value("sorted(__import__('rpcnb').run(None, 'from torch.distributed.rpc import api"
                   "\\nsorted(api._all_gather(1))', fetch=True, local=True, timeout=60)"
                   "['worker1'])")
    assert got == sorted([f"kernel_{k2.pid}", "worker1", "worker2"]), got


def test_a_background_loop_goes_on_through_a_restart(kept, tmp_path):
    # a training loop that runs until told to stop, printing and writing its step where the
    # test sees it; on worker2, a cell that fails while no kernel is attached
    progress, stop, failed = tmp_path / "step", tmp_path / "stop", tmp_path / "failed"
    k = kept.kernel()
    start(k)
    old = f"kernel_{k.pid}"
    k.execute(f"%%remote worker1 --bg --fetch\nimport os, time\nresult, step = None, 0\n"
              f"while not os.path.exists({str(stop)!r}):\n    step += 1\n"
              f"    open({str(progress)!r}, 'w').write(str(step))\n"
              f"    print('step', step)\n    time.sleep(0.05)\n"
              f"result = 'trained'\nresult")
    # it waits until this member knows the kernel is gone, then fails
    k.execute(f"%%remote worker2 --bg\nimport time, rpcnb.session.state as st\n"
              f"while not st.current().is_dead({old!r}):\n    time.sleep(0.05)\n"
              f"print('about to fail')\ntry:\n    1 / 0\nfinally:\n"
              f"    open({str(failed)!r}, 'w').write('x')")
    assert wait_until(lambda: progress.exists() and progress.read_text() != "", 10)
    kept.restart(k)
    assert wait_until(failed.exists, 30)
    seen = int(progress.read_text() or 0)
    assert wait_until(lambda: int(progress.read_text() or 0) > seen + 5, 10)  # it goes on
    out = k.execute("%rpc_init --attach")
    assert "worker1 runs" in out.stdout, out.stdout  # busy, said on attach
    assert f"[1] on worker1 still runs `import os, time` (started by {old}" in out.stdout, \
        out.stdout
    assert f"[2] on worker2 ran `import time, rpcnb.session.state as st` (started by {old}) " \
        f"and ended" in out.stdout and "failed: ZeroDivisionError" in out.stdout, out.stdout
    # what they printed while no kernel was attached, and the failure's traceback
    shown = k.execute("%rpc_jobs 2").stdout
    assert "about to fail" in shown and "ZeroDivisionError" in shown and "1 / 0" in shown, shown
    steps = k.execute("%rpc_jobs 1").stdout
    printed = [int(line.split()[-1]) for line in steps.splitlines() if line.startswith("step ")]
    assert printed and printed[-1] > seen, steps
    # both are this kernel's background cells now: listed without --all
    table = k.execute("%rpc_jobs").text
    assert "[1]" in table and "running" in table, table
    assert "[2]" in table and "failed: ZeroDivisionError" in table, table
    assert f"started by {old}" in table, table
    # what the loop prints now goes into the cell that attached, each line marked
    marked = k.later(out.msg_id, until=lambda ms: any(
        m["msg_type"] == "stream" and "[worker1] step" in m["content"]["text"] for m in ms))
    assert any("[worker1] step" in m["content"].get("text", "") for m in marked), marked
    stop.touch()  # its result is there once it ends
    assert k.value("__import__('rpcnb').jobs()[0].result(60)") == "trained"
    assert int(k.execute("%%remote worker1 --fetch\nstep").text) >= seen + 5
    with pytest.raises(AssertionError, match="ZeroDivisionError"):
        k.value("__import__('rpcnb').jobs(True)[1].result(5)")


def test_the_attached_kernel_restarts_and_adds_workers_through_the_keeper(kept):
    # the keeper started the workers, so it replaces and adds them; the kernel asks it
    k = kept.kernel()
    start(k)
    k.execute("%%remote worker1 -o r\nw = 1\nw")
    old = kept.records()[0]["workers"]["worker1"]
    out = k.execute("%rpc_restart worker1", timeout=180)
    assert "rpcnb: worker1 was running" in out.stdout, out.stdout
    assert "The RRefs worker1 owned are lost; in this notebook: r." in out.stdout, out.stdout
    new = int(out.stdout.split("a fresh process (pid ")[1].split(")")[0])
    assert new != old and pid_alive(new) and not pid_alive(old)
    assert "NameError" in k.execute("%%remote worker1 --fetch\nw", allow_error=True).traceback
    out = k.execute("%rpc_init --add 1", timeout=180)
    assert "added 1 worker(s): worker3" in out.stdout, out.stdout
    assert k.execute("%%remote worker3 --fetch\n1 + 1").text == "2"
    assert wait_until(lambda: set(kept.records()[0]["workers"]) == {"worker1", "worker2",
                                                                   "worker3"}, 10)
    assert kept.records()[0]["workers"]["worker1"] == new


def test_an_idle_kept_group_ends_by_itself_and_leaves_nothing(kept):
    k = kept.kernel()
    start(k, "%rpc_init --workers 1 --keep 2s")
    rec = kept.records()[0]
    kept.note(k)
    k.km.shutdown_kernel(now=True)  # the notebook closed
    kept.kernels.remove(k)
    gone = [rec["pid"], *rec["workers"].values()]
    assert wait_until(lambda: not any(pid_alive(p) for p in gone), 20)
    assert kept.records() == [] and not shm.leftovers(rec["group_id"])
    assert not Path(rec["folder"]).exists()


def test_two_kernels_cannot_drive_one_group(kept):
    k = kept.kernel()
    start(k)
    other = kept.kernel()
    out = other.execute("%rpc_init --attach", allow_error=True)
    assert f"has a kernel attached already: kernel_{k.pid}" in out.traceback, out.traceback
    # the first one still drives it
    assert k.execute("%%remote worker1 --fetch\n6 * 7").text == "42"


def test_a_worker_that_died_meanwhile_is_said_dead_on_attach(kept):
    k = kept.kernel()
    start(k)
    rec = kept.records()[0]
    kept.restart(k)
    os.kill(rec["workers"]["worker2"], signal.SIGKILL)
    assert wait_until(lambda: "worker2" in kept.records()[0]["dead"], 15)
    out = k.execute("%rpc_init --attach")
    assert "worker2 died while no kernel was attached" in out.stdout, out.stdout
    assert k.execute("%%remote worker1 --fetch\n1 + 1").text == "2"


def test_kept_flags_say_what_to_do(kept):
    k = kept.kernel()
    out = k.execute("%rpc_init --keep", allow_error=True)
    assert "give --workers N" in out.stderr
    out = k.execute("%rpc_init --workers 1 --keep soon", allow_error=True)
    assert "--keep takes how long" in out.stderr
    out = k.execute("%rpc_init --attach", allow_error=True)
    assert "There is no kept group to attach to" in out.stderr
    out = k.execute("%rpc_shutdown --group nothere", allow_error=True)
    assert "There is no kept group 'nothere'" in out.stderr


def reply(k: Kernel, comm_id: str, action: str, timeout: float = 30, **args) -> dict:
    """The panel's ``action`` asked over its comm, and the kernel's answer."""
    ident = time.monotonic_ns()
    send(k, comm_id, {"type": "action", "action": action, "id": ident, **args})
    return wait_for(k, comm_id, lambda d: d.get("type") == "reply" and d["id"] == ident,
                    timeout=timeout)


def fresh(k: Kernel, comm_id: str, pred) -> dict:
    """The panel's next picture that ``pred`` accepts, asked for anew: one it sent while
    the test read something else (a cell's output, a reply) is sent again."""
    send(k, comm_id, {"type": "watch", "detail": "full"})
    return wait_for(k, comm_id, snapshot_where(pred))["snapshot"]


def test_the_panel_lists_kept_groups_attaches_and_ends_one(kept):
    k = kept.kernel()
    start(k, "%rpc_init --workers 1 --keep 10m")
    k.execute("%%remote worker1\nw = 42")
    rec = kept.records()[0]
    kept.restart(k)
    # a kernel in no group: the panel lists the kept group, not attached, with its memory
    comm_id = open_comm(k)
    snap = wait_for(k, comm_id, snapshot_where(lambda s: s.get("kept")))["snapshot"]
    assert snap["group"] is None and snap["message"] == panel.NO_GROUP
    [row] = snap["kept"]
    assert (row["name"], row["pid"], row["workers"]) == ("group1", rec["pid"], ["worker1"])
    assert row["attached"] == "" and not row["mine"] and row["dead"] == {}
    assert row["keep_s"] == 600 and row["idle_since"] and row["since"] == rec["since"]
    assert row["memory"] > 10 << 20  # the keeper's and worker1's resident memory
    assert row["gpu"] == {"worker1": []}  # no CUDA here: %rpc_groups says "no GPU"
    assert "no GPU" in k.execute("%rpc_groups").stdout
    # the status item's level leaves the kept groups out
    send(k, comm_id, {"type": "watch", "detail": "summary"})
    assert "kept" not in wait_for(k, comm_id, snapshot_where(lambda s: "rrefs" not in s))[
        "snapshot"]

    # attach: the panel adds the line to the notebook and runs it; the old value is back
    said = reply(k, comm_id, "attach", group="group1")
    assert said["ok"] and said["insert"] == "%rpc_init --attach group1", said
    assert said["message"] == panel_actions.ATTACH_ADDED.format(group="group1")
    assert "attached to kept group group1" in k.execute(said["insert"]).stdout
    assert k.execute("%%remote worker1 --fetch\nw").text == "42"
    snap = fresh(k, comm_id, lambda s: s["group"] and s["kept"] and s["kept"][0]["mine"])
    assert snap["kept"][0]["attached"] == f"kernel_{k.pid}"
    # the restart button of a worker: the keeper, which started it, replaces it
    said = reply(k, comm_id, "restart", member="worker1", timeout=120)
    assert said["ok"] and said["message"].startswith("restarted worker1"), said
    assert "NameError" in k.execute("%%remote worker1 --fetch\nw", allow_error=True).traceback
    # the keeper's record, written each second, may be between the two (no worker1 yet)
    assert wait_until(lambda: kept.records()[0]["workers"].get("worker1") not in (
        None, rec["workers"]["worker1"]), 10)
    rec = kept.records()[0]
    # a kernel in a group attaches to nothing more
    said = reply(k, comm_id, "attach", group="group1")
    assert not said["ok"] and said["message"] == errors.ALREADY_INITIALIZED.format(
        name=f"kernel_{k.pid}"), said
    # end, from the kernel attached: as %rpc_shutdown there, nothing is left
    said = reply(k, comm_id, "end", group="group1", timeout=60)
    assert said["ok"] and said["message"] == panel_actions.KEPT_ENDED.format(group="group1"), said
    snap = fresh(k, comm_id, lambda s: s["group"] is None)
    assert snap["kept"] == []
    assert not any(pid_alive(p) for p in [rec["pid"], *rec["workers"].values()])
    assert kept.records() == [] and not shm.leftovers(rec["group_id"])


def test_the_doctor_lists_kept_groups_and_the_panel_ends_one_from_another_group(kept):
    k = kept.kernel()
    start(k, "%rpc_init --workers 1 --keep 10m")
    rec = kept.records()[0]
    found = {(f["member"], f["check"]): f
             for f in json.loads(k.execute("%rpc_doctor --json").stdout)}
    mine = found[("kept", "group1")]
    assert mine["level"] == "ok" and mine["detail"] == (
        f"keeper pid {rec['pid']}, workers worker1; attached: kernel_{k.pid} (this kernel)")
    # a kernel in a group of its own: the kept group, idle, is a note with its limit
    kept.restart(k)
    k.execute("%rpc_init")
    found = {(f["member"], f["check"]): f
             for f in json.loads(k.execute("%rpc_doctor --json").stdout)}
    idle = found[("kept", "group1")]
    assert idle["level"] == "note", idle
    assert idle["detail"].startswith(f"keeper pid {rec['pid']}, workers worker1; no kernel "
                                     "attached for "), idle
    assert " s of 600 s (it ends by itself in " in idle["detail"], idle
    assert idle["todo"] == errors.KEPT_IDLE_TODO.format(group="group1")
    text = k.execute("%rpc_doctor --text").stdout
    assert any(line.startswith("-- kept") and "group1" in line for line in text.splitlines()), text
    # a worker of it dies: a problem
    os.kill(rec["workers"]["worker1"], signal.SIGKILL)
    assert wait_until(lambda: "worker1" in kept.records()[0]["dead"], 15)
    found = {(f["member"], f["check"]): f
             for f in json.loads(k.execute("%rpc_doctor --json").stdout)}
    dead = found[("kept", "group1")]
    assert dead["level"] == "warn" and "dead: worker1 (" in dead["detail"], dead
    assert dead["todo"] == errors.KEPT_DEAD_TODO.format(group="group1")
    # the panel of this kernel (in its own group) ends the kept group, as --group does
    comm_id = open_comm(k)
    snap = wait_for(k, comm_id, snapshot_where(lambda s: s.get("kept")))["snapshot"]
    assert snap["group"]["me"] == "worker0" and not snap["kept"][0]["mine"]
    said = reply(k, comm_id, "end", group="group1", timeout=60)
    assert said["ok"] and said["message"] == panel_actions.KEPT_ENDED.format(group="group1"), said
    fresh(k, comm_id, lambda s: s["kept"] == [])
    assert not pid_alive(rec["pid"]) and kept.records() == []
    assert "worker0" in k.execute("%rpc_workers").text  # its own group goes on
    said = reply(k, comm_id, "end", group="group1")
    assert not said["ok"] and "There is no kept group 'group1'" in said["message"], said
    assert ("kept", "group1") not in {
        (f["member"], f["check"]) for f in json.loads(k.execute("%rpc_doctor --json").stdout)}


def test_a_record_whose_keeper_is_gone_is_no_group_even_when_its_pid_is_taken(kept):
    """A keeper killed by SIGKILL leaves its record; Linux gives its pid out again. A
    process that got that pid later is not taken for the keeper: the group is not listed,
    cannot be ended, and the process is not signalled."""
    import subprocess

    from rpcnb.procs.processes import started_at

    other = subprocess.Popen(["sleep", "120"])
    kept.pids.add(other.pid)
    try:
        folder = kept.run / "kept" / "group1"
        folder.mkdir(parents=True, mode=0o700)
        was = started_at(other.pid)
        assert was is not None
        # what the killed keeper wrote: this pid, and when that keeper started (earlier)
        (folder / "record.json").write_text(json.dumps({
            "name": "group1", "keep_s": 600.0, "pid": other.pid, "started": was - 100,
            "workers": {"worker1": other.pid}}))
        k = kept.kernel()
        assert "group1" not in k.execute("%rpc_groups").stdout
        out = k.execute("%rpc_shutdown --group group1", allow_error=True)
        assert "There is no kept group 'group1'" in out.stderr, out.stderr
        assert other.poll() is None, "the process that took the keeper's pid was signalled"
        assert not folder.exists()  # the stale record is removed
    finally:
        other.kill()
        other.wait(5)
