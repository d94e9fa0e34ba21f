"""rpcnb's channel prediction against TensorPipe's own word (TP_VERBOSE_LOGGING=7): real
processes, real pipes. The default set; restricted --channels in both orders; and, where
the test may create network namespaces, two members in different ones (transport uv)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from conftest import DRIVER, PAIRS, run_driver


def check(result: dict, pairs: set[str]) -> None:
    predicted, observed = result["predicted"], result["observed"]
    assert pairs <= set(observed), f"TensorPipe's log shows no pipe for {pairs - set(observed)}"
    for pair in pairs:
        want, got = predicted[pair], observed[pair]
        assert got["transport"] == want["transport"], (pair, want, got)
        assert got["channels"] == want["channels"], (pair, want, got)


@pytest.mark.parametrize(("chosen", "channel"), [
    ("", "cma"),
    ("mpt_uv,basic", "mpt_uv"),
    ("basic,mpt_uv", "basic"),
])
def test_prediction_matches_tensorpipe_log(tmp_path, chosen, channel):
    out = tmp_path / "result.json"
    result = run_driver(["group", str(out), chosen], out)
    check(result, PAIRS)
    # and the model says why, with the facts it was given
    reason = result["predicted"]["worker1->worker2"]["reason"]
    assert reason.startswith(f"{channel}:")
    if chosen:
        assert "cma: not in worker2's --channels" in reason
    # rpcnb's default transport is uv (TensorPipe's shm transport busy-polls when idle)
    assert {p["transport"] for p in result["predicted"].values()} == {"uv"}


def test_members_in_different_network_namespaces_use_uv(tmp_path, netns):
    out, store = tmp_path / "result.json", tmp_path / "store"
    logs = [tmp_path / "m0.log", tmp_path / "m1.log"]
    env = dict(os.environ, TORCH_CPP_LOG_LEVEL="ERROR")
    cmds = [
        ([sys.executable, DRIVER, "member", str(out), str(store), "m0", "0"], netns["here"]),
        (["ip", "netns", "exec", netns["ns"], sys.executable, DRIVER, "member", str(out),
          str(store), "m1", "1"], netns["there"]),
    ]
    procs = []
    try:
        for (cmd, iface), log in zip(cmds, logs, strict=True):
            with open(log, "wb") as f:
                # a static group also meets over Gloo, which must use the veth too
                procs.append(subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT,
                                              env=dict(env, TP_SOCKET_IFNAME=iface,
                                                       GLOO_SOCKET_IFNAME=iface)))
        deadline = time.monotonic() + 120
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            if any(p.poll() not in (None, 0) for p in procs):
                break  # one failed: the other would wait for it
            time.sleep(0.1)
        texts = [log.read_text(errors="replace") for log in logs]
        assert all(p.returncode == 0 for p in procs), "\n".join(t[-2000:] for t in texts)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(5)
    from rpcnb.observe import channels

    predicted = json.loads(out.read_text())["predicted"]
    observed: dict[tuple[str, str], dict] = {}
    for text in texts:
        for key, seen in channels.observed(text).items():
            entry = observed.setdefault(key, {"transport": None, "channels": set()})
            entry["transport"] = seen["transport"] or entry["transport"]
            entry["channels"] |= seen["channels"]
    for pair in ("m0->m1", "m1->m0"):
        src, dst = pair.split("->")
        assert observed[(src, dst)]["transport"] == predicted[pair]["transport"] == "uv"
        assert sorted(observed[(src, dst)]["channels"]) == predicted[pair]["channels"]
    # cma's descriptor has no network namespace in it: the channel stays cma
    assert predicted["m0->m1"]["channels"] == ["cma"]
    assert "different network namespaces" not in predicted["m0->m1"]["reason"]
