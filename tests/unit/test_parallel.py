"""Data-parallel bookkeeping without a process group: shares, no-op collectives, the launch
contract's errors, and the config key. Real two-rank runs are in tests/system."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from areal.config import ConfigError, load_config
from areal.trainer.parallel import DataParallel, init_data_parallel
from areal.trainer.step import _equal_micro_batches


@given(st.lists(st.integers(1, 500), min_size=0, max_size=40), st.integers(1, 5))
def test_shares_partition_the_minibatch_and_balance_tokens(lens, world) -> None:
    idx = list(range(len(lens)))
    shares = [DataParallel(r, world).share(idx, lens) for r in range(world)]
    assert sorted(i for s in shares for i in s) == idx
    loads = [sum(lens[i] for i in s) for s in shares]
    # Longest-first to the lightest rank: no rank exceeds another by more than one sequence.
    assert max(loads) - min(loads) <= max(lens, default=0)


def test_shares_balance_tokens_not_counts() -> None:
    lens = [100, 10, 10, 10, 10, 10]
    a, b = (DataParallel(r, 2).share(range(6), lens) for r in range(2))
    assert a == [0] and b == [1, 2, 3, 4, 5]


def test_a_world_of_one_needs_no_process_group() -> None:
    dp = DataParallel()
    assert dp.is_main and not dp.enabled
    assert dp.all_reduce([1.0, 2.0]) == [1.0, 2.0]
    assert dp.broadcast_object({"a": [1]}) == {"a": [1]}
    assert dp.share([3, 1, 2], [5, 5, 5, 5]) == [1, 2, 3]
    assert dp.reduce_stats({"x": 1.0, "y_max": 2.0}) == {"x": 1.0, "y_max": 2.0}
    p = torch.nn.Parameter(torch.ones(2))
    p.grad = torch.full((2,), 3.0)
    dp.all_reduce_grads([p])
    assert p.grad.tolist() == [3.0, 3.0]


def test_without_world_size_there_is_no_process_group(monkeypatch) -> None:
    for var in ("WORLD_SIZE", "RANK"):
        monkeypatch.delenv(var, raising=False)
    dp = init_data_parallel(1, 0, timeout_s=5)
    assert (dp.rank, dp.world_size) == (0, 1)


def test_launch_mistakes_say_what_to_set(monkeypatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(ValueError, match="WORLD_SIZE=2 but trainer.parallel.dp=4"):
        init_data_parallel(4, 1, timeout_s=5)
    with pytest.raises(ValueError, match="RANK=1 but --index 0"):
        init_data_parallel(2, 0, timeout_s=5)
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    with pytest.raises(ValueError, match="MASTER_ADDR is not set"):
        init_data_parallel(2, 1, timeout_s=5)


def test_dp_config_key_is_validated() -> None:
    assert load_config(None, []).trainer.parallel.dp == 1  # the paper's default: one rank
    assert load_config(None, ["trainer.parallel.dp=2"]).trainer.parallel.dp == 2
    with pytest.raises(ConfigError, match="trainer.parallel.dp must be > 0"):
        load_config(None, ["trainer.parallel.dp=0"])
    # 16 prompts x 8 responses = 128 trajectories, 4 minibatches: 64 ranks would idle
    with pytest.raises(ConfigError, match="every rank needs a share of every minibatch"):
        load_config(None, ["trainer.parallel.dp=64"])


class PeerWithMoreMicroBatches(DataParallel):
    """This rank's view when another rank cut its share into `peer_n_mbs` micro-batches."""

    def __init__(self, peer_n_mbs: int):
        super().__init__()
        self.peer_n_mbs = peer_n_mbs

    def all_reduce(self, values, op="sum"):
        assert op == "max"
        return [max(v, self.peer_n_mbs) for v in values]


@pytest.mark.parametrize("peer_n_mbs", [1, 2, 3, 5])
def test_every_rank_runs_the_largest_micro_batch_count(peer_n_mbs) -> None:
    seqs = [[0] * n for n in (6, 5, 4, 30)]
    share = [0, 1, 2]  # 15 tokens: one micro-batch under a budget of 32
    mbs = _equal_micro_batches(seqs, share, (32, 1), PeerWithMoreMicroBatches(peer_n_mbs))
    assert len(mbs) == max(1, peer_n_mbs)
    assert sorted(i for mb in mbs for i in mb) == share  # split, never duplicated or lost
    # Three sequences make three micro-batches at most; the rest are empty (run nothing).
    assert sum(1 for mb in mbs if not mb) == max(0, peer_n_mbs - 3)
