"""Pipeline parallelism of the megatron backend on CPU (gloo, real processes): two PPO
steps at PP=2 give PP=1's statistics and weights; the tied embedding's two copies (first
stage's embedding, last stage's output layer) stay equal; a run with pp=2 trains.

Each layout runs in spawned processes (megatron's parallel state is per process); results
come back as safetensors and JSON files, never pickle.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

from areal.comm.net import free_port
from areal.models.tiny import make_tiny_model
from areal.trainer.optimizer import OptimizerSpec
from areal.trainer.parallel import init_data_parallel
from areal.trainer.step import train_step
from tests.system.conftest import join_world
from tests.system.test_data_parallel import STEP_ARGS, make_trajectories
from tests.system.test_run import processes_mentioning, read_metrics, run_train

# A small clip threshold: the global norm over both stages decides every update.
OPT = OptimizerSpec(
    lr=1e-2, weight_decay=0.0, betas=(0.9, 0.999), adam_eps=1e-3, grad_clip=0.05, warmup_steps=0
)
N_STEPS = 2


def _rank_main(rank: int, pp: int, model_dir: str, out_dir: str, port: int) -> None:
    from areal.trainer.megatron.backend import MegatronBackend, data_parallel_group

    join_world(rank, pp, port)
    out = Path(out_dir)
    world = init_data_parallel(1, rank, timeout_s=120, model_parallel=pp)
    try:
        backend = MegatronBackend(model_dir, pp=pp, optimizer=OPT, save_dtype="float32", seed=1)
        dp = data_parallel_group(world)
        trajs = make_trajectories(backend.shape.vocab_size)
        stats = [
            train_step(backend, trajs, dp=dp, **{**STEP_ARGS, "seed": s}) for s in range(N_STEPS)
        ]
        (out / f"pp{pp}_rank{rank}.json").write_text(json.dumps(stats))
        backend.save_hf(out / f"pp{pp}" if rank == 0 else None)
        tied = backend.gpt.shared_embedding_or_output_weight()
        if tied is not None:
            save_file({"w": tied.detach().contiguous()}, out / f"pp{pp}_tied{rank}.safetensors")
    finally:
        world.close()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    model_dir = make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", warmup_steps=0)
    out = tmp_path_factory.mktemp("out")
    for pp in (1, 2):
        mp.spawn(_rank_main, args=(pp, str(model_dir), str(out), free_port()), nprocs=pp)
    return model_dir, out


def test_two_pipeline_stages_train_like_one(runs):
    _, out = runs
    one = json.loads((out / "pp1_rank0.json").read_text())
    for rank in (0, 1):  # the last stage's statistics reached the first (rank 0 reports)
        two = json.loads((out / f"pp2_rank{rank}.json").read_text())
        assert len(two) == len(one) == N_STEPS
        for s1, s2 in zip(one, two, strict=True):
            assert sorted(s2) == sorted(s1)
            assert s1["grad_norm"] > OPT.grad_clip  # clipping is at work
            for key, v in s1.items():
                assert s2[key] == pytest.approx(v, rel=1e-4, abs=1e-6), (rank, key)


def test_two_pipeline_stages_update_the_weights_like_one(runs):
    model_dir, out = runs
    one, two = load_file(out / "pp1/model.safetensors"), load_file(out / "pp2/model.safetensors")
    start = load_file(model_dir / "model.safetensors")
    assert sorted(two) == sorted(one)
    for k in one:
        assert not torch.equal(one[k], start[k]) or "norm" in k, k  # the steps moved it
        assert torch.allclose(two[k], one[k], atol=1e-5, rtol=0), (k, (two[k] - one[k]).abs().max())


def test_the_tied_embedding_copies_stay_equal(runs):
    _, out = runs
    first = load_file(out / "pp2_tied0.safetensors")["w"]
    last = load_file(out / "pp2_tied1.safetensors")["w"]
    assert torch.equal(first, last)


def test_a_run_with_two_pipeline_stages(tmp_path):
    """The launcher starts tp * pp * dp = 2 trainer ranks; the run exits 0 with metrics."""
    steps = 4
    proc = run_train(
        tmp_path,
        f"total_train_steps={steps}",
        "trial_name=pp2",
        "trainer.backend=megatron",
        "trainer.parallel.pp=2",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = read_metrics(tmp_path / "tiny/pp2")
    assert [m["version"] for m in metrics] == list(range(1, steps + 1))
    assert all(m["grad_norm"] > 0 for m in metrics)
    # The published weights are the trainer's: fresh tokens' log-probs agree (short answers
    # in float32: about 1e-6; 1e-3 leaves room for a rare token).
    assert max(m["train/fresh_logprob_diff_max"] for m in metrics) < 1e-3
    assert processes_mentioning(str(tmp_path)) == []
