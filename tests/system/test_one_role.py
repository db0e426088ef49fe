"""A role started alone, as docs/concepts/architecture.md says for debugging: `python -m
areal.worker --role reward --exp-dir DIR` in a prepared experiment directory registers itself,
answers signed requests, refuses unsigned ones, and stops cleanly on SIGTERM."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
from pathlib import Path

from areal.comm.registry import Registry, create_key
from areal.comm.rpc import RpcClient, RpcTimeout
from areal.config import load_config, save_config

ROOT = Path(__file__).resolve().parents[2]


def test_the_reward_role_alone(tmp_path):
    cfg = load_config(None, [f"fileroot={tmp_path}"])
    key = create_key(cfg.exp_dir)
    save_config(cfg, cfg.exp_dir / "config.yaml")
    log = tmp_path / "reward.log"
    cmd = [sys.executable, "-m", "areal.worker", "--role", "reward", "--exp-dir", str(cfg.exp_dir)]
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        address = Registry(cfg.exp_dir).lookup("reward", 0, timeout=120)

        async def calls():
            good, forged = RpcClient(address, key), RpcClient(address, b"x" * 32)
            try:
                rewards = await good.call(
                    "grade", timeout=60, task="arith", responses=["so it is 5", "7"], answer="5"
                )
                try:
                    await forged.call("stats", timeout=2)
                    answered = True
                except RpcTimeout:
                    answered = False
                return rewards, answered, await good.call("stats", timeout=30)
            finally:
                good.close()
                forged.close()

        rewards, forged_answered, stats = asyncio.run(calls())
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, log.read_text()[-2000:]
    finally:
        proc.kill()
        proc.wait(timeout=30)
    assert rewards == [cfg.reward.correct, cfg.reward.wrong] and not forged_answered
    assert stats["graded"] == 2
    assert "dropped a frame" in log.read_text()
