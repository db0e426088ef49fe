"""Data-parallel training over two real gloo ranks on loopback equals one rank.

Each rank is a process of its own (torch.multiprocessing spawn); rank 0 reads the batch
and broadcasts it as msgpack bytes, exactly as the trainer worker does. Results come back
as safetensors and JSON files, never pickle.
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

import areal.trainer.step as step_mod
from areal.comm import wire
from areal.comm.net import free_port
from areal.models.tiny import make_tiny_model
from areal.trainer.optimizer import OptimizerSpec
from areal.trainer.parallel import init_data_parallel
from areal.trainer.ppo_config import PPOConfig
from areal.trainer.step import train_step
from areal.trainer.torch_backend import TorchBackend
from areal.trajectory import Trajectory
from tests.system.conftest import join_world
from tests.system.test_run import (
    _wait_for,
    cmdline,
    launched,
    processes_mentioning,
    read_metrics,
    run_train,
)

OBJECTIVES = {
    "areal": PPOConfig(behav_imp_weight_cap=2.0, n_minibatches=2),
    # Masks over the whole batch (M2PO), per-sequence aggregation, the sequence ratio: each
    # needs a count or a cut that spans the ranks.
    "m2po_gspo_drgrpo": PPOConfig(
        n_minibatches=2,
        m2po_tau=0.06,
        adv_estimator="grpo",
        importance_sampling_level="sequence",
        eps_clip=0.05,
        loss_agg="seq_mean_token_sum_norm",
        loss_agg_norm_len=16,
    ),
    # The m2po recipe's cut weighs only the tokens whose weight moved with their advantage:
    # the advantages, every rank's, decide which tokens its gathered cut sees.
    "m2po_recipe": PPOConfig(recipe="m2po", n_minibatches=2),
    # REINFORCE++'s per-token whitening: a mean and a variance over the tokens of all ranks
    # (long-tailed lengths, so per-token and per-sequence statistics differ).
    "reinforce_pp": PPOConfig(
        recipe="reinforce_pp", kl_coef=0.0, behav_imp_weight_cap=2.0, n_minibatches=2
    ),
}
STEP_ARGS = dict(
    ppo=OBJECTIVES["areal"],
    max_tokens_per_mb=40,  # the longest sequence: several micro-batches per rank
    seed=3,
)


def make_backend(model_dir) -> TorchBackend:
    return TorchBackend.from_dir(
        model_dir,
        optimizer=OptimizerSpec(
            lr=1e-2,
            weight_decay=0.0,
            betas=(0.9, 0.999),
            adam_eps=1e-3,  # keeps Adam's first step proportional to the gradient (test_step)
            grad_clip=1e9,
            warmup_steps=0,
        ),
        device="cpu",
    )


def make_trajectories(vocab: int, n: int = 14) -> list[Trajectory]:
    """Long-tailed lengths (a few long sequences) and stale behaviour log-probs."""
    rng = random.Random(0)
    trajs = []
    for k in range(n):
        n_out = rng.choice([3, 4, 6, 8, 30])
        out = [rng.randrange(vocab) for _ in range(n_out)]
        trajs.append(
            Trajectory(
                group_id=k // 2,
                prompt_ids=[rng.randrange(vocab) for _ in range(rng.randint(3, 10))],
                output_ids=out,
                logprobs=[-6.0 + rng.gauss(0, 0.3) for _ in out],
                versions=[0] * n_out,
                reward=rng.choice([5.0, -5.0]),
            )
        )
    return trajs


class Recorder:
    """Spies on one training run: forwards, micro-batch counts, gradients after the sum."""

    def __init__(self, backend: TorchBackend):
        self.seqs: list[list[int]] = []
        self.n_mbs: list[int] = []
        self.grads: list[list[torch.Tensor]] = []
        real_logprobs, real_step = backend.logprobs, backend.optimizer_step
        real_equal = step_mod._equal_micro_batches

        def logprobs(seqs, starts=None, with_entropy=False):
            if torch.is_grad_enabled():  # the update's forwards, not the proximal one
                self.seqs += [list(s) for s in seqs]
            return real_logprobs(seqs, starts, with_entropy)

        def optimizer_step():
            self.grads.append([p.grad.detach().clone() for p in backend.model.parameters()])
            return real_step()

        def equal(*args, **kw):
            mbs = real_equal(*args, **kw)
            self.n_mbs.append(len(mbs))
            return mbs

        backend.logprobs, backend.optimizer_step = logprobs, optimizer_step
        step_mod._equal_micro_batches = equal  # callers restore it (monkeypatch)


def _rank_main(
    rank: int, model_dir: str, batch_file: str, out_dir: str, port: int, objective: str
) -> None:
    join_world(rank, 2, port)
    dp = init_data_parallel(2, rank, timeout_s=60)
    try:
        backend = make_backend(model_dir)
        rec = Recorder(backend)
        # Rank 0 reads the batch, the other rank receives it as msgpack bytes.
        wire_batch = wire.unpack(Path(batch_file).read_bytes()) if rank == 0 else None
        wire_batch = dp.broadcast_object(wire_batch)
        trajs = [Trajectory.from_wire(d) for d in wire_batch]
        stats = train_step(backend, trajs, dp=dp, **{**STEP_ARGS, "ppo": OBJECTIVES[objective]})
        out = Path(out_dir)
        tensors = {f"grad{k}.{j}": g for k, gs in enumerate(rec.grads) for j, g in enumerate(gs)}
        tensors.update({f"param.{j}": p.detach() for j, p in enumerate(backend.model.parameters())})
        save_file({k: v.contiguous() for k, v in tensors.items()}, out / f"rank{rank}.safetensors")
        info = {"stats": stats, "seqs": rec.seqs, "n_mbs": rec.n_mbs, "n_steps": len(rec.grads)}
        (out / f"rank{rank}.json").write_text(json.dumps(info))
    finally:
        dp.close()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", warmup_steps=0)


def run_single(model_dir, trajs, objective: str = "areal"):
    torch.set_num_threads(1)
    backend = make_backend(model_dir)
    rec = Recorder(backend)
    return backend, rec, train_step(backend, trajs, **{**STEP_ARGS, "ppo": OBJECTIVES[objective]})


@pytest.mark.parametrize("objective", list(OBJECTIVES))
def test_two_gloo_ranks_equal_one_rank(model_dir, tmp_path, monkeypatch, objective):
    # The spy replaces step._equal_micro_batches in this process; restore it afterwards.
    monkeypatch.setattr(step_mod, "_equal_micro_batches", step_mod._equal_micro_batches)
    vocab = make_backend(model_dir).model.config.vocab_size
    trajs = make_trajectories(vocab)
    batch_file = tmp_path / "batch.msgpack"
    batch_file.write_bytes(wire.pack([t.to_wire() for t in trajs]))

    mp.spawn(
        _rank_main,
        args=(str(model_dir), str(batch_file), str(tmp_path), free_port(), objective),
        nprocs=2,
    )
    single, rec, s_one = run_single(model_dir, trajs, objective)

    infos = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    tensors = [load_file(tmp_path / f"rank{r}.safetensors") for r in range(2)]
    # The ranks split the work: disjoint sequences that together are the whole batch, and
    # the same number of micro-batches per minibatch on both.
    seqs = [t.prompt_ids + t.output_ids for t in trajs]
    ran = [sorted(seqs.index(s) for s in info["seqs"]) for info in infos]
    assert set(ran[0]).isdisjoint(ran[1]) and ran[0] and ran[1]
    assert sorted(ran[0] + ran[1]) == list(range(len(trajs)))
    assert infos[0]["n_mbs"] == infos[1]["n_mbs"]
    assert sum(infos[0]["n_mbs"]) >= 4  # the split really cut several micro-batches
    lens = [len(seqs[i]) for i in range(len(seqs))]
    loads = [sum(lens[i] for i in r) for r in ran]
    assert abs(loads[0] - loads[1]) <= max(lens)  # balanced by tokens, not by count
    # ... and computed the update of one rank running the whole batch.
    assert infos[0]["n_steps"] == infos[1]["n_steps"] == len(rec.grads) == 2
    for k, grads in enumerate(rec.grads):
        for j, g in enumerate(grads):
            for t in tensors:
                assert torch.allclose(t[f"grad{k}.{j}"], g, atol=1e-6, rtol=1e-4), (k, j)
    for j, p in enumerate(single.model.parameters()):
        assert torch.allclose(tensors[0][f"param.{j}"], p.detach(), atol=1e-5, rtol=0)
        assert torch.equal(tensors[0][f"param.{j}"], tensors[1][f"param.{j}"])
    for key, value in s_one.items():
        for info in infos:
            assert info["stats"][key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
    # The cap (or M2PO's cut) and its normaliser were exercised, and M2PO kept most tokens.
    assert 0 < s_one["loss/n_capped_tokens"] < s_one["loss/n_valid_tokens"]


def _dead_peer_main(rank: int, port: int, out_dir: str) -> None:
    join_world(rank, 2, port)
    dp = init_data_parallel(2, rank, timeout_s=10)
    if rank == 1:
        os._exit(0)  # dies without a word, as a killed rank would
    t0 = time.time()
    Path(out_dir, "t0").write_text(str(t0))
    try:
        dp.all_reduce([1.0])
        outcome = "returned"
    except Exception as e:  # gloo reports a lost peer as RuntimeError or DistBackendError
        outcome = type(e).__name__
    Path(out_dir, "outcome.json").write_text(json.dumps([outcome, time.time() - t0]))


def test_a_dead_peer_fails_the_collective_instead_of_hanging(tmp_path):
    ctx = mp.start_processes(
        _dead_peer_main, args=(free_port(), str(tmp_path)), nprocs=2, join=False
    )
    deadline = time.time() + 60
    try:
        while not ctx.join(timeout=1) and time.time() < deadline:
            pass
    except mp.ProcessExitedException as e:
        # Now and then gloo aborts the survivor (std::terminate as it drops the lost peer's
        # connection) instead of raising: the rank fails too, and the launcher sees it exit.
        assert e.error_index == 0 and e.signal_name == "SIGABRT", e
        t0 = float((tmp_path / "t0").read_text())
        (tmp_path / "outcome.json").write_text(json.dumps(["SIGABRT", time.time() - t0]))
    outcome, seconds = json.loads((tmp_path / "outcome.json").read_text())
    assert outcome != "returned"
    assert seconds < 15


# ---------------------------------------------------------------- whole runs with dp = 2

# No supervised warm-up: these runs check processes, not learning, and the model is made
# in a second instead of a minute.
FAST_MODEL = "model.tiny_warmup_steps=0"


def test_tiny_run_with_two_trainer_ranks_and_resume(tmp_path):
    """The launcher starts trainer0 and trainer1; the run ends when both exit 0; a resumed
    run loads the checkpoint on both ranks and continues."""
    exp_dir = tmp_path / "tiny/dp"
    common = ("trial_name=dp", "trainer.parallel.dp=2", "trainer.save_freq_steps=2")
    proc = run_train(tmp_path, "total_train_steps=3", FAST_MODEL, *common, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = read_metrics(exp_dir)
    assert [m["version"] for m in metrics] == [1, 2, 3]
    assert all(m["trainer/dp"] == 2 for m in metrics)
    assert all(m["loss/n_valid_tokens"] == m["train/n_tokens"] for m in metrics)  # no cap
    assert (exp_dir / "logs/trainer1.log").exists()
    assert sorted(p.name for p in (exp_dir / "checkpoints").iterdir()) == ["v000003"]

    proc = run_train(
        tmp_path, "total_train_steps=5", "resume=true", FAST_MODEL, *common, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resuming from" in proc.stdout
    assert [m["version"] for m in read_metrics(exp_dir)] == [1, 2, 3, 4, 5]
    assert sorted(p.name for p in (exp_dir / "checkpoints").iterdir()) == ["v000005"]
    assert processes_mentioning(str(tmp_path)) == []


def test_a_killed_trainer_rank_stops_the_run(tmp_path):
    exp_dir = tmp_path / "tiny/dpkill"
    overrides = (
        "total_train_steps=100000",
        "trial_name=dpkill",
        "trainer.parallel.dp=2",
        "recover.max_restarts=0",  # the contract without automatic recovery
        FAST_MODEL,
    )
    with launched(tmp_path, *overrides) as launcher:
        _wait_for(lambda: (exp_dir / "metrics.jsonl").exists(), 300, "a training step")
        victims = [
            p
            for p in processes_mentioning(str(tmp_path))
            if "--role trainer --index 1" in cmdline(p)
        ]
        assert len(victims) == 1
        os.kill(victims[0], signal.SIGKILL)
        out, err = launcher.communicate(timeout=60)
    assert launcher.returncode != 0
    assert "role trainer1 was killed by SIGKILL" in err, err[-2000:]
    _wait_for(lambda: processes_mentioning(str(tmp_path)) == [], 10, "no orphans")
