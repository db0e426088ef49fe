"""launcher.type=inline: a short tiny run with every role in this test's process."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

from areal.checkpoint import latest
from areal.train import main as train_main
from areal.trainer import ppo

ROOT = Path(__file__).resolve().parents[2]
STEPS, ETA = 4, 1


def _children() -> list[int]:
    """This process's child processes (from /proc)."""
    kids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == os.getpid():
                kids.append(int(entry.name))
    return kids


def test_an_inline_run_trains_in_this_process_within_the_staleness_bound(tmp_path, monkeypatch):
    calls: list[tuple[str, list[int]]] = []
    real_loss = ppo.policy_loss

    def loss(*args, **kwargs):  # where a newcomer puts a breakpoint
        calls.append((threading.current_thread().name, _children()))
        return real_loss(*args, **kwargs)

    monkeypatch.setattr(ppo, "policy_loss", loss)
    before = set(_children())  # whatever earlier tests of this session left running
    rc = train_main(
        [
            "--config", str(ROOT / "configs/tiny.yaml"), f"fileroot={tmp_path}",
            "launcher.type=inline", f"total_train_steps={STEPS}", f"max_staleness={ETA}",
            "trainer.batch_size=4", "rollout.group_size=4", "model.tiny_warmup_steps=0",
            "trainer.save_freq_steps=2",
        ]
    )  # fmt: skip
    assert rc == 0
    exp = tmp_path / "tiny" / "run0"
    lines = [json.loads(ln) for ln in (exp / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == list(range(1, STEPS + 1))
    assert [m["version"] for m in lines] == list(range(1, STEPS + 1))
    assert all(0 <= m["staleness/max"] <= ETA for m in lines)
    assert latest(exp).version == STEPS  # checkpoints as in a normal run
    # The loss ran in this process, on the thread that called main, with no child process.
    assert calls and {name for name, _ in calls} == {threading.current_thread().name}
    assert all(set(kids) <= before for _, kids in calls)  # the run started none
