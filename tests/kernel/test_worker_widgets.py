"""Widgets made on a worker are real widgets in the notebook: their models reach the front
end (a real kernel, driven here as JupyterLab drives it: comm messages on the shell and
iopub channels), and what the front end sends reaches the widget on the worker."""

from __future__ import annotations

import os
import signal
import time

from conftest import worker_pids

VIEW = "application/vnd.jupyter.widget-view+json"


def opened(out, model: str) -> list[dict]:
    return [m for m in out.comms if m["msg_type"] == "comm_open"
            and m["content"]["data"].get("state", {}).get("_model_name") == model]


def front_end_sets(k, comm_id: str, **state) -> None:
    """What JupyterLab sends when a control is moved in the page."""
    msg = k.kc.session.msg("comm_msg", {"comm_id": comm_id, "data": {
        "method": "update", "state": state, "buffer_paths": []}})
    k.kc.shell_channel.send(msg)


def test_a_slider_made_on_a_worker_is_a_widget_both_ways(group):
    out = group.execute("%%remote worker1\nimport ipywidgets as w\n"
                        "s = w.IntSlider(value=3, description='lr')\ndisplay(s)")
    (slider,) = opened(out, "IntSliderModel")
    cid = slider["content"]["comm_id"]
    assert slider["content"]["target_name"] == "jupyter.widget"
    assert slider["content"]["data"]["state"]["value"] == 3
    views = [d for d in out.displays if VIEW in d["data"]]
    assert views and views[-1]["data"][VIEW]["model_id"] == cid  # the view of that model
    kinds = [kind for _, kind, _ in out.events]
    assert kinds.index("comm_open") < kinds.index("display_data")  # model before its view

    front_end_sets(group, cid, value=7)  # moved in the page
    assert group.execute("%%remote worker1 --fetch\ns.value").text == "7"

    changed = group.execute("%%remote worker1\ns.value = 9")  # set on the worker
    states = [m["content"]["data"].get("state", {}) for m in changed.comms
              if m["msg_type"] == "comm_msg" and m["content"]["comm_id"] == cid]
    assert {"value": 9} in states, changed.comms


def test_tqdm_notebook_on_two_workers(group):
    out = group.execute("%%remote --all\nfrom tqdm.notebook import tqdm\nimport time\n"
                        "for i in tqdm(range(5)):\n    time.sleep(0.05)\n")
    bars = opened(out, "IntProgressModel") + opened(out, "FloatProgressModel")
    assert len(bars) == 2, [m["content"]["data"]["state"].get("_model_name") for m in
                            out.comms if m["msg_type"] == "comm_open"]
    finals = {}
    for m in out.comms:
        if m["msg_type"] == "comm_msg":
            value = m["content"]["data"].get("state", {}).get("value")
            if value is not None:
                finals[m["content"]["comm_id"]] = value
    assert {finals.get(b["content"]["comm_id"]) for b in bars} == {5}
    shown = {d["data"][VIEW]["model_id"] for d in out.displays if VIEW in d["data"]}
    assert len(shown) == 2  # each worker's bar is shown


def test_interact_on_a_worker_answers_the_page(group):
    out = group.execute("%%remote worker1\nfrom ipywidgets import interact\n"
                        "@interact(x=3)\ndef f(x):\n    print('x is', x)\n")
    (slider,) = opened(out, "IntSliderModel")
    outputs = [m for m in out.comms if "x is 3" in str(m["content"]["data"])]
    assert outputs, "the first result is not in the Output widget"
    assert "x is 3" not in out.stdout  # inside the widget, not the cell
    front_end_sets(group, slider["content"]["comm_id"], value=5)
    group.later("", timeout=20, until=lambda _: any(  # reads into .stray
        "x is 5" in str(m["content"].get("data")) for m in group.stray
        if m["msg_type"] == "comm_msg"))
    assert any("x is 5" in str(m["content"].get("data")) for m in group.stray
               if m["msg_type"] == "comm_msg"), "the page's change did not reach interact"


def test_a_dead_workers_widgets_close_and_nothing_hangs(own_group):
    out = own_group.execute("%%remote worker2\nimport ipywidgets as w\nb = w.Button()\ndisplay(b)")
    (button,) = opened(out, "ButtonModel")
    cid = button["content"]["comm_id"]
    os.kill(worker_pids(own_group)["worker2"], signal.SIGKILL)
    deadline = time.monotonic() + 20
    closed = False
    while time.monotonic() < deadline and not closed:
        own_group.later("", until=lambda _: False, timeout=0.5)  # reads into .stray
        closed = any(m["msg_type"] == "comm_close" and m["content"]["comm_id"] == cid
                     for m in own_group.stray)
    assert closed, "the dead worker's widget stayed open in the front end"
    front_end_sets(own_group, cid, description="clicked")  # a message for it: dropped
    t0 = time.monotonic()
    assert own_group.execute("1 + 1").text == "2"
    assert time.monotonic() - t0 < 5
    assert own_group.execute("%%remote worker1 --fetch\n6 * 7").text == "42"


def test_a_missing_widget_library_says_what_to_install(group):
    out = group.execute("%%remote worker1\nimport sys\nsys.modules['ipywidgets'] = None\n"
                        "import ipywidgets", allow_error=True)
    assert "ipywidgets is not installed on worker1" in out.traceback, out.traceback
    assert "pip install ipywidgets" in out.traceback
    assert group.execute("%%remote worker1 --fetch\n1 + 1").text == "2"
    group.execute("%%remote worker1\ndel sys.modules['ipywidgets']")  # installed again


def test_an_anywidget_made_on_a_worker(group):
    out = group.execute(
        "%%remote worker1\nimport anywidget, traitlets\n"
        "class Counter(anywidget.AnyWidget):\n"
        "    _esm = 'export default { render({ model, el }) { el.textContent = model.get(\"count\"); } }'\n"
        "    count = traitlets.Int(4).tag(sync=True)\n"
        "c = Counter()\ndisplay(c)")
    (widget,) = opened(out, "AnyModel")
    state = widget["content"]["data"]["state"]
    assert state["count"] == 4 and "export default" in state["_esm"]
    front_end_sets(group, widget["content"]["comm_id"], count=11)
    assert group.execute("%%remote worker1 --fetch\nc.count").text == "11"


def test_shutdown_closes_the_workers_widgets(own_group):
    # twice on one kernel: its second group closes its widgets as the first did
    for _ in range(2):
        out = own_group.execute("%%remote worker1\nimport ipywidgets as w\nt = w.Text('x')\n"
                                "display(t)")
        (box,) = opened(out, "TextModel")
        down = own_group.execute("%rpc_shutdown")
        closed = [m["content"]["comm_id"] for m in down.comms if m["msg_type"] == "comm_close"]
        assert box["content"]["comm_id"] in closed, down.comms
        # a message a stale page sends it afterwards is dropped, and nothing hangs
        front_end_sets(own_group, box["content"]["comm_id"], value="y")
        t0 = time.monotonic()
        assert own_group.execute("1 + 1").text == "2"
        assert time.monotonic() - t0 < 5
        own_group.execute("%rpc_init --workers 2")
