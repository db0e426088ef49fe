"""Automatic recovery: real SIGKILLs of a trainer mid-step, the controller, a rollout worker
and the reward service, one after another in one run. The launcher restarts the whole run
from its latest checkpoint each time, and the run completes its steps having trained every
draw from the dataset at most once and lost none, with every staleness within eta."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from areal.checkpoint import latest
from areal.comm.wire import unpack
from areal.cores import ledger_path
from tests.system.test_run import (
    _wait_for,
    cmdline,
    launched,
    processes_mentioning,
    read_metrics,
)

STEPS = 48  # enough that four kills, two steps apart, land before the end
ETA = 4


def cpu_ticks(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


def parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def role_pids(root: Path, role: str) -> list[int]:
    """The role's processes (not their forked grading processes, which share the command line)."""
    pids = [p for p in processes_mentioning(str(root)) if f"--role {role} " in cmdline(p)]
    return [p for p in pids if parent(p) not in pids]


def busy(pid: int) -> bool:
    """The process used most of a core over 0.3 s: the trainer is inside a step."""
    before = cpu_ticks(pid)
    time.sleep(0.3)
    return cpu_ticks(pid) - before >= 0.15 * os.sysconf("SC_CLK_TCK")


@pytest.mark.timeout(600)  # four restarts of a whole run on a loaded 2-core machine
def test_killed_roles_are_recovered_and_no_draw_is_trained_twice_or_lost(tmp_path):
    exp_dir = tmp_path / "tiny/recover"
    victims = ["trainer", "controller", "rollout", "reward"]
    overrides = (
        f"total_train_steps={STEPS}", "trial_name=recover", f"max_staleness={ETA}",
        "trainer.save_freq_steps=2", f"recover.max_restarts={len(victims)}",
        "model.tiny_warmup_steps=0",  # the model need not learn here; skip its warm-up
    )  # fmt: skip
    with launched(tmp_path, *overrides) as launcher:
        for n, role in enumerate(victims, start=1):
            # Two steps of this attempt beyond where it resumed, so every role is up.
            # The role must be running too: between the rename of logs/ and the rewind of
            # metrics.jsonl the old attempt's lines still count, with no role started yet.
            resumed = getattr(latest(exp_dir), "version", 0)
            _wait_for(
                lambda r=resumed, role=role: (
                    (exp_dir / "metrics.jsonl").exists()
                    and len(read_metrics(exp_dir)) >= r + 2
                    and len(role_pids(tmp_path, role)) == 1
                ),
                180,
                f"two steps before killing the {role}",
            )
            [pid] = role_pids(tmp_path, role)
            if role == "trainer":
                _wait_for(lambda p=pid: busy(p), 60, "the trainer inside a step")
            os.kill(pid, signal.SIGKILL)
            _wait_for(lambda n=n: (exp_dir / f"logs.attempt{n - 1}").exists(), 60, "a recovery")
        out, err = launcher.communicate(timeout=300)
    assert launcher.returncode == 0, err[-3000:]
    for n, role in enumerate(victims, start=1):
        said = f"role {role}0 was killed by SIGKILL; restarting the run from its latest checkpoint"
        assert f"{said} ({n}/{len(victims)})" in err, err[-3000:]
    assert out.count("areal: resuming from") + out.count("starting afresh") == len(victims)
    metrics = read_metrics(exp_dir)
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    assert [m["version"] for m in metrics] == list(range(1, STEPS + 1))
    assert all(m["staleness/max"] <= ETA for m in metrics)
    assert metrics[-1]["recover/restarts"] == len(victims)
    restarts = [m["recover/restarts"] for m in metrics]
    assert restarts == sorted(restarts)
    # No draw (and no group) trained twice: the metrics of the steps that stand (a recovery
    # drops the lines of the steps after its checkpoint, whose training it undid).
    trained = [d for m in metrics for d in m["batch/draw_ids"]]
    groups = [g for m in metrics for g in m["batch/group_ids"]]
    assert len(trained) == len(set(trained)) == STEPS * 16
    assert len(groups) == len(set(groups))
    # None lost: every draw taken from the dataset is trained, or in the final checkpoint's
    # buffer, or queued to be generated again.
    ckpt = latest(exp_dir)
    assert ckpt.version == STEPS
    state = unpack(ckpt.controller_state.read_bytes())
    assert state["epoch"] == 0
    ready = [g["group"][0]["draw_id"] for g in state["buffer"]["groups"]]
    retry = [row["draw_id"] for row in state["retry"]]
    assert sorted(trained + ready + retry) == list(range(state["pos"]))
    _wait_for(lambda: processes_mentioning(str(tmp_path)) == [], 10, "no orphans")
    assert not os.path.exists(ledger_path(exp_dir))  # killed roles leave it; the launcher not
