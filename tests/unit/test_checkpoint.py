"""Trainer state saved as safetensors + JSON (never pickle), and atomic commits."""

from __future__ import annotations

import pytest
import torch

from areal.checkpoint import (
    latest,
    load_rank_state,
    load_trainer_state,
    save,
    save_rank_state,
    save_trainer_state,
)


def _optimizer():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
    return model, opt, sched


def test_optimizer_and_scheduler_state_round_trip(tmp_path):
    model, opt, sched = _optimizer()
    for _ in range(3):
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    state = {"optimizer": opt.state_dict(), "scheduler": sched.state_dict()}
    save_trainer_state(tmp_path, state)
    assert b"pickle" not in (tmp_path / "trainer.json").read_bytes()

    model2, opt2, sched2 = _optimizer()
    loaded = load_trainer_state(tmp_path)
    opt2.load_state_dict(loaded["optimizer"])
    sched2.load_state_dict(loaded["scheduler"])
    for k, s in opt.state_dict()["state"].items():
        for name, value in s.items():
            assert torch.equal(value, opt2.state_dict()["state"][k][name]), (k, name)
    assert sched2.last_epoch == 3 and sched2.get_last_lr() == sched.get_last_lr()
    # The same next step from both.
    model2.load_state_dict(model.state_dict())
    x = torch.randn(2, 4)
    for m, o in ((model, opt), (model2, opt2)):
        m(x).sum().backward()
        o.step()
    assert torch.allclose(model.weight, model2.weight)


def test_commit_makes_the_latest_and_drops_older(tmp_path):
    assert latest(tmp_path) is None
    for v in (4, 8):
        save(tmp_path, v, lambda d: (d / "part").write_text("x"))
    half_written = tmp_path / "checkpoints" / "v000012.tmp"
    half_written.mkdir()
    ckpt = latest(tmp_path)
    assert ckpt.version == 8 and ckpt.path.name == "v000008"
    assert not (tmp_path / "checkpoints" / "v000004").exists()


def test_a_rank_state_keyed_like_megatrons_optimizer_round_trips(tmp_path):
    """Megatron's gathered optimizer state is keyed by ints and (dtype, dtype) tuples."""
    key = (torch.bfloat16, torch.float32)
    state = {
        "buckets_coalesced": True,
        0: {key: {"param": torch.arange(4.0), "exp_avg": torch.ones(4)}},
        "dtype": torch.float16,
    }
    save_rank_state(tmp_path, "optimizer-tp1-pp0", state)
    back = load_rank_state(tmp_path, "optimizer-tp1-pp0")
    assert back["buckets_coalesced"] is True and back["dtype"] == torch.float16
    assert list(back[0]) == [key]
    assert torch.equal(back[0][key]["param"], torch.arange(4.0))
    assert torch.equal(back[0][key]["exp_avg"], torch.ones(4))
    with pytest.raises(ValueError, match="optimizer-tp0-pp1.json"):
        load_rank_state(tmp_path, "optimizer-tp0-pp1")
