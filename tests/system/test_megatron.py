"""The megatron backend over real gloo ranks on loopback: logits equal the HF model's at
TP=1 and TP=2, a packed micro-batch equals its sequences run alone, TP=2 weights come back
bit-exact, DP=2 gradients equal DP=1, and a tiny run with trainer.backend=megatron learns.

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
from transformers import AutoModelForCausalLM

from areal.comm.net import free_port
from areal.models.tiny import make_tiny_model
from areal.trainer.optimizer import OptimizerSpec
from areal.trainer.parallel import init_data_parallel
from areal.trainer.step import train_step
from tests.system.conftest import join_world
from tests.system.test_data_parallel import STEP_ARGS, make_trajectories
from tests.system.test_run import processes_mentioning, read_metrics, run_train

SEQS = [[5, 9, 14, 3, 22, 7, 1], [40, 2, 2], [11, 12, 13, 14, 15], [30, 31]]
STARTS = [4, 0, 3, 1]  # the first stream entry the caller reads, per sequence
OPT = OptimizerSpec(
    lr=1e-2, weight_decay=0.0, betas=(0.9, 0.999), adam_eps=1e-3, grad_clip=1e9, warmup_steps=0
)


def _backend(model_dir: str, tp: int):
    from areal.trainer.megatron.backend import MegatronBackend

    return MegatronBackend(model_dir, tp=tp, optimizer=OPT, save_dtype="float32")


def _grads(backend) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in backend.gpt.named_parameters()}


def _rank_main(rank: int, nprocs: int, model_dir: str, out_dir: str, port: int) -> None:
    """Layout TP=nprocs: logits, packed vs alone, save. Then TP=1 x DP=nprocs: one step."""
    from megatron.core import parallel_state as ps

    from areal.trainer.megatron.backend import data_parallel_group

    join_world(rank, nprocs, port)
    out = Path(out_dir)
    world = init_data_parallel(1, rank, timeout_s=120, model_parallel=nprocs)
    try:
        backend = _backend(model_dir, tp=nprocs)
        logits = backend.logits(SEQS)
        packed = backend.logprobs(SEQS).detach()
        alone = torch.cat([backend.logprobs([s]).detach() for s in SEQS])
        started = backend.logprobs(SEQS, STARTS).detach()
        backend.save_hf(out / f"saved_tp{nprocs}" if rank == 0 else None)
        if rank == 0:
            save_file(
                {
                    "logits": logits.contiguous(),
                    "packed": packed,
                    "alone": alone,
                    "started": started,
                },
                out / f"tp{nprocs}.safetensors",
            )
        # Same world, new layout: every rank a data-parallel replica of the whole model.
        ps.destroy_model_parallel()
        backend = _backend(model_dir, tp=1)
        dp = data_parallel_group(world)
        trajs = make_trajectories(backend.shape.vocab_size)
        seen = []
        real_step = backend.optimizer_step

        def optimizer_step():
            seen.append(_grads(backend))
            return real_step()

        backend.optimizer_step = optimizer_step
        stats = train_step(backend, trajs, dp=dp, **STEP_ARGS)
        grads = {f"{k}.{n}": g for k, gs in enumerate(seen) for n, g in gs.items()}
        save_file(grads, out / f"dp{nprocs}_rank{rank}.safetensors")
        (out / f"dp{nprocs}_rank{rank}.json").write_text(json.dumps(stats))
    finally:
        world.close()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The two layouts' outputs: one process (TP=1, DP=1) and two (TP=2, then DP=2)."""
    model_dir = make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", warmup_steps=0)
    out = tmp_path_factory.mktemp("out")
    for n in (1, 2):
        mp.spawn(_rank_main, args=(n, str(model_dir), str(out), free_port()), nprocs=n)
    return model_dir, out


def test_logits_equal_the_hf_model_at_tp1_and_tp2(runs):
    model_dir, out = runs
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        ref = torch.cat([hf(input_ids=torch.tensor([s])).logits[0] for s in SEQS])
    for tp in (1, 2):
        got = load_file(out / f"tp{tp}.safetensors")["logits"]
        assert got.shape == ref.shape
        assert torch.allclose(got, ref, atol=2e-5, rtol=0), (tp, (got - ref).abs().max())


def test_a_packed_micro_batch_equals_its_sequences_alone(runs):
    _, out = runs
    for tp in (1, 2):
        r = load_file(out / f"tp{tp}.safetensors")
        assert r["packed"].shape == (sum(len(s) - 1 for s in SEQS),)
        assert torch.allclose(r["packed"], r["alone"], atol=1e-5, rtol=0), tp


def test_starts_zero_the_entries_before_them_and_change_nothing_after(runs):
    """The megatron backend honours `starts` like the torch one (test_packed_attention)."""
    _, out = runs
    scored = torch.cat([torch.arange(len(s) - 1) >= k for s, k in zip(SEQS, STARTS, strict=True)])
    assert 0 < int(scored.sum()) < len(scored)
    for tp in (1, 2):
        r = load_file(out / f"tp{tp}.safetensors")
        assert r["started"].shape == r["packed"].shape
        assert torch.equal(r["started"][~scored], torch.zeros(int((~scored).sum())))
        assert torch.allclose(r["started"][scored], r["packed"][scored], atol=1e-6, rtol=0), tp


def test_weights_come_back_bit_exact_from_tp1_and_tp2(runs):
    model_dir, out = runs
    ref = load_file(model_dir / "model.safetensors")
    for tp in (1, 2):
        got = load_file(out / f"saved_tp{tp}/model.safetensors")
        assert sorted(got) == sorted(ref)
        assert all(torch.equal(got[k], ref[k]) for k in ref), tp
        config = json.loads((out / f"saved_tp{tp}/config.json").read_text())
        assert config["torch_dtype"] == "float32"
        assert (out / f"saved_tp{tp}/tokenizer.json").exists()


def test_two_data_parallel_replicas_equal_one(runs):
    _, out = runs
    one = load_file(out / "dp1_rank0.safetensors")
    two = [load_file(out / f"dp2_rank{r}.safetensors") for r in range(2)]
    assert len(one) == len(two[0]) and {k.split(".")[0] for k in one} == {"0", "1"}
    for k, g in one.items():
        for t in two:
            assert torch.allclose(t[k], g, atol=1e-6, rtol=1e-4), k
    s1 = json.loads((out / "dp1_rank0.json").read_text())
    s2 = json.loads((out / "dp2_rank1.json").read_text())
    for key in ("loss/n_valid_tokens", "loss/ppo", "loss/clipfrac", "grad_norm"):
        assert s2[key] == pytest.approx(s1[key], rel=1e-4, abs=1e-6), key


def test_tiny_run_with_the_megatron_backend_learns(tmp_path):
    """test_tiny_run_learns's criterion on trainer.backend=megatron. 100 steps, as that test's:
    at 60 the best 20-step window rose +0.0 to +3.2 over seeds 1-4 (+0.9 once in CI on seed
    1); at 100, +4.8, +1.5, +2.3 on seeds 1, 2, 5, and once in CI on seed 1 it fell (first
    window -2.50, best -2.36: the asynchronous run differs run to run). So a second seed runs
    when the first does not learn: both must fail for the test to (issue 60)."""
    steps, tried = 100, []
    for seed in (1, 5):
        trial = f"meg{seed}"
        proc = run_train(
            tmp_path, f"total_train_steps={steps}", f"trial_name={trial}",
            "trainer.backend=megatron", f"seed={seed}",
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
        metrics = read_metrics(tmp_path / "tiny" / trial)
        assert [m["version"] for m in metrics] == list(range(1, steps + 1))
        # The published fp32 weights are the trainer's: fresh tokens' log-probs agree
        # (short answers in float32: about 1e-6; 1e-3 leaves room for a rare token).
        assert sum(m["train/fresh_tokens"] for m in metrics) > 0
        assert max(m["train/fresh_logprob_diff_max"] for m in metrics) < 1e-3
        rewards = [m["reward/mean"] for m in metrics]
        means = [sum(rewards[i : i + 20]) / 20 for i in range(0, steps - 19, 10)]
        tried.append((seed, means))
        if max(means) > means[0] + 1.0:
            break
    else:
        raise AssertionError(f"no seed learned: {tried}")
    assert processes_mentioning(str(tmp_path)) == []
