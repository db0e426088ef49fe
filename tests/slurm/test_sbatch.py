"""`sbatch scripts/run_math.sh` on a real two-node SLURM with fake GPUs (slurm/test_cluster.sh).

Each job runs the tiny config on both nodes: server0 on n1 (on its GPU), trainer0 on n2 (on
its GPU), the services beside the server: every step of a real plan, as srun steps. One job
uses no GPU (launcher.gpus_per_node=0), the CPU placement.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slurm

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    """One tiny model for every job here (making it per job would dominate their time)."""
    from areal.models.tiny import make_tiny_model

    return Path(make_tiny_model(tmp_path_factory.mktemp("model") / "tiny", seed=1, warmup_steps=50))


def sbatch(
    tmp_path: Path, model: Path, *overrides: str, gpus: int = 1, wait: bool = False, nodes: int = 2
) -> str:
    """Submit run_math.sh with the tiny config, using `gpus` per node; returns the job id
    (with wait, once the job has ended)."""
    cmd = [
        "sbatch",
        "--parsable",
        "-N",
        str(nodes),
        "--gpus-per-node=1",  # the script asks for 8; each test node has 4 fake ones
        f"--output={tmp_path / 'job.out'}",
        "scripts/run_math.sh",
        "--config",
        "configs/tiny.yaml",
        f"fileroot={tmp_path}",
        f"model.path={model}",
        f"launcher.gpus_per_node={gpus}",
        *overrides,
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    job = proc.stdout.strip().split(";")[0]
    if wait:  # not sbatch --wait: it polls at growing intervals, up to 20 s late here
        wait_for(lambda: job_state(job) in ENDED, 300, f"job {job} to end")
    return job


ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")


def job_state(job: str) -> str:
    out = subprocess.run(
        ["scontrol", "show", "job", job], capture_output=True, text=True, timeout=30
    ).stdout
    return next(f.split("=", 1)[1] for f in out.split() if f.startswith("JobState="))


def job_processes(job: str) -> list[str]:
    """Command lines of processes (on any node: all are on this host) of SLURM job `job`."""
    found = []
    for p in Path("/proc").iterdir():
        try:
            env = (p / "environ").read_bytes().split(b"\0")
            if f"SLURM_JOB_ID={job}".encode() in env and p.name != str(os.getpid()):
                found.append((p / "cmdline").read_bytes().replace(b"\0", b" ").decode())
        except (OSError, ValueError):
            continue
    return [c for c in found if "slurmstepd" not in c]


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")


def metrics(tmp_path: Path) -> list[dict]:
    path = tmp_path / "tiny/run0/metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.endswith("}")]


def role_pid(tmp_path: Path, role: str) -> int | None:
    for p in Path("/proc").iterdir():
        try:
            cmd = (p / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if (
            b"areal.worker" in cmd
            and role.encode() in cmd
            and str(tmp_path).encode() in b" ".join(cmd)
        ):
            return int(p.name)
    return None


def test_sbatch_run_completes(tmp_path, tiny_model):
    job = sbatch(tmp_path, tiny_model, "total_train_steps=10", wait=True)
    out = (tmp_path / "job.out").read_text()
    assert job_state(job) == "COMPLETED", out[-3000:]
    assert [m["step"] for m in metrics(tmp_path)] == list(range(1, 11)), out[-3000:]
    # The plan put the server and the trainer on different nodes, each with its GPU.
    assert "n1: server0 [gpu 0], reward0, rollout0, controller0" in out
    assert "n2: trainer0 [gpu 0]" in out
    assert "run finished" in out
    assert (tmp_path / "tiny/run0/registry/server/0").read_text().startswith("http://127.0.0.1:")
    assert job_processes(job) == []


def test_one_gpu_is_shared_by_the_server_and_the_trainer(tmp_path, tiny_model):
    """A one-node, one-GPU job: the trainer's step overlaps the server's on its GPU (without
    --overlap SLURM could not create it while the server holds the GPU)."""
    job = sbatch(tmp_path, tiny_model, "total_train_steps=5", wait=True, nodes=1)
    out = (tmp_path / "job.out").read_text()
    assert job_state(job) == "COMPLETED", out[-3000:]
    assert "n1: server0 [gpu 0], reward0, rollout0, controller0, trainer0 [gpu 0, shared" in out
    assert [m["step"] for m in metrics(tmp_path)] == list(range(1, 6)), out[-3000:]
    assert job_processes(job) == []


def test_a_dead_step_fails_the_job(tmp_path, tiny_model):
    overrides = ("total_train_steps=100000", "recover.max_restarts=0")
    job = sbatch(tmp_path, tiny_model, *overrides, gpus=0)
    try:
        wait_for(lambda: metrics(tmp_path), 240, "the first training step")
        out = (tmp_path / "job.out").read_text()
        assert "2 nodes, CPU only" in out and "n2: trainer0\n" in out, out[-3000:]
        pid = role_pid(tmp_path, "reward")
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        wait_for(lambda: job_state(job) == "FAILED", 30, "the job to fail")
        assert time.monotonic() - killed < 30
        out = (tmp_path / "job.out").read_text()
        assert "role reward0 was killed by SIGKILL" in out, out[-3000:]
        wait_for(lambda: job_processes(job) == [], 20, "every process of the job to end")
    finally:
        subprocess.run(["scancel", job], timeout=30)


def test_scancel_leaves_no_process(tmp_path, tiny_model):
    job = sbatch(tmp_path, tiny_model, "total_train_steps=100000")
    try:
        wait_for(lambda: metrics(tmp_path), 240, "the first training step")
        assert any("areal.worker" in c for c in job_processes(job))
        subprocess.run(["scancel", job], check=True, timeout=30)
        wait_for(lambda: job_state(job) == "CANCELLED", 30, "the job to be cancelled")
        left = wait_for(lambda: job_processes(job) == [] or None, 30, "the job's processes to end")
        assert left
        assert role_pid(tmp_path, "trainer") is None and role_pid(tmp_path, "rollout") is None
    finally:
        subprocess.run(["scancel", job], timeout=30)


def test_a_killed_server_step_is_restarted_on_its_gpu(tmp_path, tiny_model):
    """The launcher restarts a dead server as a new srun step holding the same GPU; its
    rollout worker finds the new address and routes to it again."""
    job = sbatch(tmp_path, tiny_model, "total_train_steps=100000")
    run = tmp_path / "tiny/run0"
    try:
        wait_for(lambda: metrics(tmp_path), 240, "the first training step")
        port = (run / "registry/server/0").read_text().rsplit(":", 1)[1]
        server = next(
            int(p.name)
            for p in Path("/proc").iterdir()
            if p.name.isdigit() and f"--port {port} ".encode() in _cmdline(p) + b" "
        )
        os.kill(server, signal.SIGKILL)
        log = run / "logs/controller0.log"
        wait_for(lambda: "inference server 0 is back" in log.read_text(), 120, "server 0 back")
        out = (tmp_path / "job.out").read_text()
        assert "role server0 was killed by SIGKILL (srun exit code 137); restarting it (1/3)" in out
        server_log = (run / "logs/server0.log").read_text()
        # Both starts: on node n1's GPU, as the plan placed it.
        assert server_log.count("areal: CUDA_VISIBLE_DEVICES=0\n") == 2, server_log[-3000:]
        n_back = len(metrics(tmp_path))
        wait_for(lambda: len(metrics(tmp_path)) >= n_back + 3, 60, "training to go on")
        assert job_state(job) == "RUNNING"
    finally:
        subprocess.run(["scancel", job], timeout=30)
    wait_for(lambda: job_processes(job) == [], 30, "the job's processes to end")


def _cmdline(p: Path) -> bytes:
    try:
        return (p / "cmdline").read_bytes().replace(b"\0", b" ")
    except OSError:
        return b""


def test_a_step_that_cannot_be_created_fails_the_job_at_once(tmp_path, tiny_model):
    """Another step of the job holds n2's GPU, so trainer0's step cannot be created: the job
    fails within seconds naming the step, its node and what it asked for (no recovery can
    help), instead of waiting for the registry timeout."""
    script = tmp_path / "job.sh"
    script.write_text(
        "#!/bin/bash\n"
        "set -euo pipefail\n"
        f"cd {ROOT}\n"
        "srun --nodes=1 --ntasks=1 --nodelist=n2 --exact --gpus-per-node=1 sleep 300 &\n"
        "sleep 2\n"  # its step holds the GPU before the run starts
        f"AREAL_ROOT={ROOT} source slurm/env.sh\n"
        "python -m areal.train --config configs/tiny.yaml launcher.type=slurm "
        f"fileroot={tmp_path} model.path={tiny_model} launcher.gpus_per_node=1 "
        "total_train_steps=100000\n"
    )
    cmd = ["sbatch", "--parsable", "-N", "2", "--gpus-per-node=1", "--ntasks-per-node=1",
           f"--output={tmp_path / 'job.out'}", str(script)]  # fmt: skip
    job = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60).stdout
    job = job.strip().split(";")[0]
    try:
        started = time.monotonic()
        wait_for(lambda: job_state(job) in ENDED, 120, "the job to end")
        assert time.monotonic() - started < 90
        out = (tmp_path / "job.out").read_text()
        assert job_state(job) == "FAILED", out[-3000:]
        assert "SLURM could not create step trainer0 on node n2 (it asks for 1 GPU(s)" in out
        assert "Requested nodes are busy" in out and "restarting" not in out, out[-3000:]
    finally:
        subprocess.run(["scancel", job], timeout=30)
