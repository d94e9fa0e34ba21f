"""Slurm: a one-node Slurm of the test's own (Debian's munged, slurmctld and slurmd with a
private key, socket, configuration and ports, SLURM_CONF pointing at it) runs ipyparallel's
Slurm launcher's engines and the headless worker through the batch script of
docs/clusters.md. Skipped, with the reason, where the daemons are missing or cannot run.
Every daemon, job step and worker is stopped by pid at the end."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import worker_pids

from rpcnb.procs.processes import kill_all, pid_alive

ROOT = Path(__file__).resolve().parents[2]
DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "squeue", "scancel")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _with_env(name: str, value: str) -> list[int]:
    """Every process whose environment has name=value (our daemons and their job steps)."""
    want = f"{name}={value}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if want in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    missing = [d for d in DAEMONS if shutil.which(d) is None and
               not os.path.exists(f"/usr/sbin/{d}")]
    if missing:
        pytest.skip(f"Slurm is not installed ({', '.join(missing)} missing: apt install "
                    "slurm-wlm munge)")
    if os.geteuid() != 0:
        pytest.skip(f"a private slurmd needs root (to start job steps); uid {os.geteuid()}")
    base = tmp_path_factory.mktemp("slurm")
    for d in ("munge", "state", "spool", "log"):
        (base / d).mkdir()
    (base / "munge").chmod(0o700)
    key = base / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    sock = base / "munge" / "sock"
    host = socket.gethostname()
    conf = base / "slurm.conf"
    (base / "plugstack.conf").write_text("")
    conf.write_text(f"""ClusterName=rpcnbtest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
AuthType=auth/munge
AuthInfo=socket={sock}
CredType=cred/munge
StateSaveLocation={base}/state
SlurmdSpoolDir={base}/spool
SlurmctldPidFile={base}/ctld.pid
SlurmdPidFile={base}/d.pid
SlurmctldLogFile={base}/log/ctld.log
SlurmdLogFile={base}/log/d.log
PlugStackConfig={base}/plugstack.conf
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
SlurmUser=root
SlurmdUser=root
ReturnToService=2
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
NodeName={host} NodeAddr=127.0.0.1 CPUs={os.cpu_count() or 1} State=UNKNOWN
PartitionName=test Nodes={host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:8
""")
    env = dict(os.environ, SLURM_CONF=str(conf))
    procs = []
    try:
        procs.append(subprocess.Popen(
            ["/usr/sbin/munged", "-F", "-f", f"--key-file={key}", f"--socket={sock}",
             f"--pid-file={base}/munge/pid", f"--log-file={base}/munge/log",
             f"--seed-file={base}/munge/seed"], env=env,
            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + 10
        while not sock.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        for daemon in (["/usr/sbin/slurmctld", "-D", "-i"], ["/usr/sbin/slurmd", "-D"]):
            with open(base / "log" / f"{Path(daemon[0]).name}.out", "wb") as f:
                procs.append(subprocess.Popen(daemon, env=env, stdout=f, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + 30
        state = ""
        while time.monotonic() < deadline:
            if any(p.poll() is not None for p in procs):
                break
            info = subprocess.run(["sinfo", "-h", "-o", "%T"], env=env, capture_output=True,
                                  text=True)
            state = info.stdout.strip() or info.stderr.strip()
            if state == "idle":
                break
            time.sleep(0.5)
        if state != "idle":
            logs = "\n".join(p.read_text(errors="replace")[-500:] for p in (base / "log").glob("*"))
            logs += f" (exit codes {[p.poll() for p in procs]})"
            pytest.skip(f"a one-node Slurm cannot run here (node state {state!r}): {logs}")
        yield env
    finally:
        subprocess.run(["scancel", "--full", "-u", "root"], env=env, capture_output=True)
        time.sleep(0.5)
        kill_all(sorted(set(_with_env("SLURM_CONF", str(conf))) - {os.getpid()}))
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(5)


def docs_sbatch_script() -> str:
    """The sbatch script docs/clusters.md shows users."""
    text = (ROOT / "docs" / "clusters.md").read_text()
    scripts = re.findall(r"```bash\n(#!/bin/bash\n#SBATCH.*?)```", text, re.S)
    assert len(scripts) == 1, "docs/clusters.md should show one sbatch script"
    return scripts[0]


def test_the_docs_sbatch_script_joins_headless_workers(slurm, kernel_factory, tmp_path):
    kernel = kernel_factory(env=slurm)
    kernel.execute("%load_ext rpcnb")
    kernel.execute("%rpc_init --port 0")
    join = kernel.value("__import__('rpcnb.session.state').session.state.current().init_method")
    conn = kernel.value("str(__import__('rpcnb.session.state').session.state.current().connection_path)")
    script = docs_sbatch_script()
    # the user's two edits: the group's address, and where the connection file was copied
    script = script.replace("tcp://10.0.0.5:29500", join)
    script = re.sub(r"(?m)^TOKEN=.*$", f"TOKEN={conn}", script)
    # one node here: 2 tasks instead of 2 nodes x 4, and the checkout on PYTHONPATH
    script = script.replace("#SBATCH --nodes=2", "#SBATCH --nodes=1")
    script = script.replace("#SBATCH --ntasks-per-node=4", "#SBATCH --ntasks-per-node=2")
    script = script.replace("\nsrun ", f"\nexport PYTHONPATH={ROOT}\nsrun ", 1)
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0
    path = tmp_path / "workers.sbatch"
    path.write_text(script)
    # as from a shell with the environment activated: `python` is this one
    env = dict(slurm, PATH=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}")
    out = subprocess.run(["sbatch", "--parsable", f"--output={tmp_path}/job.out", str(path)],
                         env=env, capture_output=True, text=True, check=True)
    job = out.stdout.strip().split(";")[0]
    deadline = time.monotonic() + 120
    members: dict[str, int] = {}
    while time.monotonic() < deadline and len(members) < 3:
        time.sleep(0.5)
        members = worker_pids(kernel)
        if time.monotonic() > deadline - 110 and not subprocess.run(
                ["squeue", "-h", "-j", job], env=slurm, capture_output=True, text=True).stdout.strip():
            break  # the job ended without joining: its output says why
    log = (tmp_path / "job.out").read_text() if (tmp_path / "job.out").exists() else ""
    assert set(members) == {"worker0", "worker1", "worker2"}, log  # from SLURM_PROCID
    got = kernel.execute("%%remote --all --fetch\nimport os\nos.environ['SLURM_JOB_ID']").text
    assert got.count(f"'{job}'") == 2, got
    kernel.execute("%rpc_shutdown")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and subprocess.run(
            ["squeue", "-h", "-j", job], env=slurm, capture_output=True, text=True).stdout.strip():
        time.sleep(0.5)
    assert not any(pid_alive(members[n]) for n in ("worker1", "worker2"))
    assert "joined the group" in (tmp_path / "job.out").read_text()


def test_slurm_launcher_engines_are_a_group(slurm, kernel_factory, tmp_path):
    kernel = kernel_factory(env=dict(slurm, PYTHONPATH=str(ROOT)))
    kernel.execute("%load_ext rpcnb")
    batch = tmp_path / "engines.sbatch"  # ipyparallel writes it in the cwd otherwise
    out = kernel.execute(f"%rpc_init --engines 2 --launcher slurm --cluster-args "
                         f"\"profile_dir={tmp_path / 'profile'} "
                         f"SlurmEngineSetLauncher.batch_file_name={batch}\"", timeout=240)
    assert out.stdout.count(" engine ") == 2, out.stdout
    script = batch.read_text()  # the batch script ipyparallel generated and submitted
    assert "#SBATCH --ntasks=2" in script and "\nsrun " in script, script
    jobs = kernel.execute("%%remote --all --fetch\nimport os\nos.environ.get('SLURM_JOB_ID')").text
    assert "None" not in jobs, jobs
    kernel.execute("%%remote worker2 -o r\nimport torch\ntorch.arange(3.) + 1")
    assert kernel.value("r.to_here().tolist()") == [1.0, 2.0, 3.0]
    pids = worker_pids(kernel)
    kernel.execute("%rpc_shutdown", timeout=120)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(pid_alive(pids[n]) for n in ("worker1", "worker2")):
        time.sleep(0.3)
    assert not any(pid_alive(pids[n]) for n in ("worker1", "worker2"))
