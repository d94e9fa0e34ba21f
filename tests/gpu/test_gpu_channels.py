"""The CUDA side of the channel model, on a machine with CUDA: the facts a member
reports about its GPUs, and the predicted CUDA channel against TensorPipe's log. Marked
``gpu``; without CUDA every test here skips and says so."""

from __future__ import annotations

import pytest
import torch

from rpcnb.observe import channels

HAS_CUDA = torch.cuda.is_available()
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not HAS_CUDA, reason=(
        f"needs CUDA: this torch ({torch.__version__}) sees no CUDA device, so there is no "
        "CUDA channel to predict or observe")),
]


def test_facts_report_the_gpus_and_peer_access():
    f = channels.Facts.from_dict(channels.local_facts())
    assert f.cuda_built
    assert [d["index"] for d in f.cuda_devices] == list(range(torch.cuda.device_count()))
    uuids = [d["uuid"] for d in f.cuda_devices]
    assert len(set(uuids)) == len(uuids)
    for d in f.cuda_devices:
        assert f.p2p[d["uuid"]][d["uuid"]] is True
    for a in f.cuda_devices:
        for b in f.cuda_devices:
            if a is not b:
                assert f.p2p[a["uuid"]][b["uuid"]] == torch.cuda.can_device_access_peer(
                    a["index"], b["index"])


def test_cuda_prediction_matches_tensorpipe_log(tmp_path):
    from conftest import run_driver

    out = tmp_path / "result.json"
    result = run_driver(["cuda", str(out)], out)
    pair = "worker0->worker1"
    want, got = result["predicted"][pair], result["observed"][pair]
    assert got["transport"] == want["transport"]
    assert got["channels"] == want["channels"]
    assert any(name.startswith("cuda_") for name in want["channels"])
