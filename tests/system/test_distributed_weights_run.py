"""Whole runs with weights.transport=distributed: versions reach the servers by broadcast.

The same weights arrive as through disk (fresh log-prob gap; tests/system/test_interruption.py
checks every token of interrupted samples against its version's model), disk copies follow
disk_every, and a server killed while an update waits
on it does not stop the run: it comes back on the newest version on disk and joins the next
group. A LoRA run sends its adapter alone.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from safetensors.torch import load_file

from areal.config import load_config
from areal.lora import is_adapter_dir, read_adapter
from tests.system.test_run import (
    _wait_for,
    cmdline,
    launched,
    processes_mentioning,
    read_metrics,
    run_train,
)

DISTRIBUTED = ("weights.transport=distributed", "weights.timeout_s=5")


def _rollout_log(exp_dir, k: int) -> str:
    return (exp_dir / f"logs/rollout{k}.log").read_text()


def test_a_distributed_run_trains_on_the_weights_it_broadcasts(tmp_path):
    steps = 12
    proc = run_train(
        tmp_path, f"total_train_steps={steps}", "trial_name=bcast", "rollout.n_servers=2",
        "weights.disk_every=5", "weights.delta=true", *DISTRIBUTED,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    exp_dir = tmp_path / "tiny/bcast"
    metrics = read_metrics(exp_dir)
    assert [m["version"] for m in metrics] == list(range(1, steps + 1))
    assert all(m["staleness/max"] <= 4 for m in metrics)
    # The weights that generated are the trainer's, to float precision.
    assert sum(m["train/fresh_tokens"] for m in metrics) > 0
    assert max(m["train/fresh_logprob_diff_max"] for m in metrics) < 1e-3
    assert metrics[-1]["rollout/server_version_min"] >= steps - 4
    # weights.delta: whole tensors to the new group, then deltas where they are smaller (in
    # float32 at this learning rate every entry changes: whole again; test_interruption.py
    # checks deltas that are smaller, token by token).
    sent = [m["weights/sent_bytes"] / m["weights/full_bytes"] for m in metrics]
    assert sent[0] == 1.0 and max(sent) <= 1.0, sent
    for k in (0, 1):  # every version by broadcast, one group for the whole run
        log = _rollout_log(exp_dir, k)
        assert "received version 1 " in log and f"received version {steps - 1} " in log, log
        assert "from disk" not in log and "is down" not in log, log
    # On disk: every fifth version, the older ones retired once a newer one was complete.
    assert [p.name for p in (exp_dir / "weights").iterdir()] == ["v000010"]


@pytest.mark.parametrize(
    "lora",
    # The LoRA run sends over gloo's sockets, the other through /dev/shm: a whole run each.
    [(), ("model.lora.rank=16", "trainer.lr=2e-3", "weights.shared_memory=false")],
    ids=["full", "lora"],
)
def test_a_server_killed_during_an_update_comes_back_and_rejoins(tmp_path, lora):
    """Server 0 stops (SIGSTOP) as the next update starts: the trainer's broadcast fails at
    the group's deadline and goes on, the update finishes without it, which is down; killed,
    it restarts on the newest version on disk and joins a new group; the run never hangs.
    With model.lora the versions are adapters: the restarted server merges the newest adapter
    directory into its base, then the broadcast adapters again (fresh log-probs equal)."""
    exp_dir = tmp_path / "tiny/bcast_kill"
    overrides = (
        "total_train_steps=100000", "trial_name=bcast_kill", "rollout.n_servers=2",
        "weights.disk_every=2", *DISTRIBUTED, *lora,
    )  # fmt: skip
    controller_log = exp_dir / "logs/controller0.log"
    with launched(tmp_path, *overrides) as launcher:
        _wait_for(
            lambda: (exp_dir / "metrics.jsonl").exists() and len(read_metrics(exp_dir)) >= 3,
            240,
            "three training steps",
        )
        url = (exp_dir / "registry/server/0").read_text()
        port = url.rsplit(":", 1)[1]
        victims = [
            p for p in processes_mentioning(str(tmp_path))
            if "areal.rollout.server" in cmdline(p) and f"--port {port} " in cmdline(p) + " "
        ]  # fmt: skip
        assert len(victims) == 1, victims
        os.kill(victims[0], signal.SIGSTOP)
        # The next update reaches it and cannot finish: the trainer's broadcast fails at the
        # group's deadline, the worker calls the server down at twice that. Then it dies.
        _wait_for(lambda: "inference server 0 is down" in controller_log.read_text(), 120, "down")
        os.kill(victims[0], signal.SIGKILL)
        _wait_for(lambda: "inference server 0 is back" in controller_log.read_text(), 180, "back")
        n_back = len(read_metrics(exp_dir))
        _wait_for(lambda: len(read_metrics(exp_dir)) >= n_back + 4, 120, "steps after it")
        launcher.send_signal(signal.SIGINT)
        _, err = launcher.communicate(timeout=60)
    assert "role server0 was killed by SIGKILL; restarting it" in err, err[-3000:]
    metrics = read_metrics(exp_dir)
    assert [m["version"] for m in metrics] == list(range(1, len(metrics) + 1))
    assert all(m["staleness/max"] <= 4 for m in metrics)
    assert min(m["rollout/servers_alive"] for m in metrics) == 1
    assert metrics[-1]["rollout/servers_alive"] == 2
    assert max(m["train/fresh_logprob_diff_max"] for m in metrics) < 1e-3
    log0 = _rollout_log(exp_dir, 0)
    # Back on a version from disk, then by broadcast again, in a group formed after it.
    back = log0.index("is back at version")
    assert "received version" in log0[back:], log0[-3000:]
    assert "loaded version" in log0[log0.index("is down") : back], log0[-3000:]
    backend = "gloo" if lora else "shm"
    assert f"as rank 1 of 3 ({backend}, " in (exp_dir / "logs/server0.log").read_text()
    _wait_for(lambda: processes_mentioning(str(tmp_path)) == [], 10, "no orphans")


@pytest.mark.timeout(180)
def test_a_lora_run_broadcasts_its_adapter_alone(tmp_path):
    """model.lora: each version is the adapter's tensors, sent over the group and merged by
    the servers (the trainer's log-probs: max_staleness=0 makes every token fresh, those
    after the first step generated with broadcast adapters); bytes per update are the
    adapter's, not the model's; every disk_every-th version is an adapter directory, as
    with the disk hand-off."""
    steps = 4
    proc = run_train(
        tmp_path, f"total_train_steps={steps}", "trial_name=lora_bcast", "rollout.n_servers=2",
        "weights.disk_every=2", "model.lora.rank=16", "trainer.lr=2e-3", "max_staleness=0",
        *DISTRIBUTED,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    exp_dir = tmp_path / "tiny/lora_bcast"
    metrics = read_metrics(exp_dir)
    assert [m["version"] for m in metrics] == list(range(1, steps + 1))
    assert all(m["train/fresh_tokens"] > 0 for m in metrics[1:]), metrics
    gaps = [m["train/fresh_logprob_diff_max"] for m in metrics[1:]]
    assert max(gaps) < 1e-4, gaps  # float32 noise: the same merge as from disk
    for k in (0, 1):
        log = _rollout_log(exp_dir, k)
        assert "received version 1 " in log and f"received version {steps - 1} " in log, log
        assert "from disk" not in log and "is down" not in log, log
    (version,) = (exp_dir / "weights").iterdir()
    assert version.name == f"v{steps:06d}" and is_adapter_dir(version)
    adapter = sum(t.numel() * t.element_size() for t in read_adapter(version)[1].values())
    model_dir = Path(load_config(str(exp_dir / "config.yaml")).model.path)
    model = sum(
        t.numel() * t.element_size() for t in load_file(model_dir / "model.safetensors").values()
    )
    for m in metrics:  # two servers, the adapter each
        assert m["weights/sent_bytes"] == m["weights/full_bytes"] == 2 * adapter, m
    assert adapter * 2 < model, (adapter, model)
