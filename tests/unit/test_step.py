"""The training step on the tiny model: packed log-probs, micro-batch invariance, decoupled
vs naive PPO, and the statistics it reports."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
import torch

import areal.trainer.ppo as ppo_mod
from areal.models.tiny import make_tiny_model
from areal.trainer.micro_batches import allocate_micro_batches
from areal.trainer.optimizer import OptimizerSpec
from areal.trainer.ppo import compute_advantages
from areal.trainer.ppo_config import PPOConfig
from areal.trainer.step import proximal_logprobs, train_step
from areal.trainer.torch_backend import TorchBackend
from areal.trajectory import Trajectory

REWARDS = [5.0, -5.0, -5.0, 5.0, 5.0, 5.0, -5.0, 5.0]  # mean = (5*5 - 3*5) / 8 = 1.25
BIG_BUDGET = 512  # > 8 sequences * 24 tokens: one micro-batch
SMALL_BUDGET = 24  # the longest sequence: many micro-batches


class RecordingBackend(TorchBackend):
    """Records the sequences of every forward and the gradients seen by each optimizer step."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls: list[list[list[int]]] = []
        self.grads: list[list[torch.Tensor]] = []

    def logprobs(self, seqs, starts=None, with_entropy=False):
        self.calls.append([list(s) for s in seqs])
        return super().logprobs(seqs, starts, with_entropy)

    def optimizer_step(self) -> float:
        self.grads.append([p.grad.detach().clone() for p in self.model.parameters()])
        return super().optimizer_step()


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny matrices: one intra-op thread is faster, and much faster on a busy machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", warmup_steps=0)


def make_backend(model_dir, **overrides) -> RecordingBackend:
    optimizer = OptimizerSpec(
        lr=1e-2,
        weight_decay=0.0,
        betas=(0.9, 0.999),
        # A large epsilon keeps Adam's first step proportional to the gradient instead of
        # ~sign(g) * lr, which would amplify float noise on near-zero gradient entries.
        adam_eps=1e-3,
        grad_clip=1e9,
        warmup_steps=0,
    )
    return RecordingBackend.from_dir(model_dir, optimizer=optimizer, device="cpu", **overrides)


def sequence_logprobs(model, seq: list[int], temperature: float = 1.0) -> torch.Tensor:
    """Reference: one plain forward of one sequence alone, then log_softmax."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([seq])).logits[0].float() / temperature
    return torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(seq[1:])[:, None])[:, 0]


@pytest.fixture(scope="module")
def trajectories(model_dir):
    """Random prompts/outputs (lengths 3-12) with the model's own behaviour log-probs, and a
    copy whose behaviour log-probs are perturbed (behaviour weight != 1)."""
    rng = random.Random(0)
    model = make_backend(model_dir).model
    vocab = model.config.vocab_size
    own, perturbed, noises = [], [], []
    gen = torch.Generator().manual_seed(0)
    for k, reward in enumerate(REWARDS):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(3, 12))]
        output = [rng.randrange(vocab) for _ in range(rng.randint(3, 12))]
        lp = sequence_logprobs(model, prompt + output)[len(prompt) - 1 :]
        noise = 0.4 * torch.randn(len(output), generator=gen)
        common = dict(group_id=k // 2, prompt_ids=prompt, output_ids=output, reward=reward)
        versions = [0] * len(output)
        own.append(Trajectory(logprobs=lp.tolist(), versions=versions, **common))
        perturbed.append(Trajectory(logprobs=(lp + noise).tolist(), versions=versions, **common))
        noises.append(noise)
    return {"own": own, "perturbed": perturbed, "noise": noises}


PPO_KEYS = {f.name for f in dataclasses.fields(PPOConfig)}


def step_args(**overrides) -> dict:
    """train_step's arguments: the ppo knobs among `overrides` make its PPOConfig."""
    knobs = {k: overrides.pop(k) for k in list(overrides) if k in PPO_KEYS}
    return dict(ppo=PPOConfig(**{"n_minibatches": 1, **knobs}), **overrides)


def run_step(model_dir, trajs, **overrides):
    backend = make_backend(model_dir)
    stats = train_step(
        backend, trajs, **step_args(**{"max_tokens_per_mb": BIG_BUDGET, **overrides})
    )
    return backend, stats


def max_abs_diff(xs, ys) -> float:
    return max((x - y).abs().max().item() for x, y in zip(xs, ys, strict=True))


def assert_same_update(a: RecordingBackend, b: RecordingBackend, tol: float = 1e-5) -> None:
    assert len(a.grads) == len(b.grads) > 0
    for ga, gb in zip(a.grads, b.grads, strict=True):
        assert max_abs_diff(ga, gb) < tol
    pa, pb = list(a.model.parameters()), list(b.model.parameters())
    assert max_abs_diff(pa, pb) < tol


# ---------------------------------------------------------------- (a) packed log-probs


def test_packed_logprobs_equal_per_sequence_forward(model_dir, trajectories) -> None:
    backend = make_backend(model_dir)
    seqs = [t.prompt_ids + t.output_ids for t in trajectories["own"]]
    stream = backend.logprobs(seqs)
    assert stream.shape == (sum(len(s) - 1 for s in seqs),)  # L-1 entries per sequence
    parts = stream.detach().split([len(s) - 1 for s in seqs])
    for seq, part in zip(seqs, parts, strict=True):
        ref = sequence_logprobs(backend.model, seq)
        assert torch.allclose(part, ref, atol=1e-5, rtol=0)
        assert (part <= 0).all()


def test_packed_logprobs_apply_the_temperature(model_dir, trajectories) -> None:
    backend = make_backend(model_dir, temperature=2.0)
    seqs = [t.prompt_ids + t.output_ids for t in trajectories["own"][:3]]
    parts = backend.logprobs(seqs).detach().split([len(s) - 1 for s in seqs])
    for seq, part in zip(seqs, parts, strict=True):
        assert torch.allclose(part, sequence_logprobs(backend.model, seq, 2.0), atol=1e-5)
        assert not torch.allclose(part, sequence_logprobs(backend.model, seq), atol=1e-3)


def test_packed_logprobs_carry_gradients(model_dir, trajectories) -> None:
    backend = make_backend(model_dir)
    seqs = [t.prompt_ids + t.output_ids for t in trajectories["own"][:2]]
    backend.logprobs(seqs).sum().backward()
    assert all(p.grad is not None for p in backend.model.parameters())


# ---------------------------------------------------------------- (b) micro-batch invariance


@pytest.mark.parametrize("variant", ["own", "perturbed"])
@pytest.mark.parametrize(
    ("budget", "min_n_mbs"),
    [(SMALL_BUDGET, 1), (BIG_BUDGET, 4), (BIG_BUDGET, len(REWARDS))],
    ids=["small-budget", "min-mbs", "one-by-one"],
)
def test_one_micro_batch_equals_many(model_dir, trajectories, variant, budget, min_n_mbs) -> None:
    trajs = trajectories[variant]
    lens = [len(t.prompt_ids) + len(t.output_ids) for t in trajs]
    assert len(allocate_micro_batches(lens, BIG_BUDGET)) == 1
    assert len(allocate_micro_batches(lens, budget, min_n_mbs)) >= 3
    common = dict(behav_imp_weight_cap=2.0)
    one, s_one = run_step(model_dir, trajs, **common)
    many, s_many = run_step(
        model_dir, trajs, max_tokens_per_mb=budget, min_n_mbs=min_n_mbs, **common
    )
    # the update really was cut differently: 1 vs >= 3 forwards with gradients
    assert len(one.calls) == 1 + 1  # proximal forward + one micro-batch
    assert len(many.calls) >= 1 + 3
    if min_n_mbs == len(trajs):  # packed or not at all: every sequence ran alone
        assert all(len(call) == 1 for call in many.calls[1:])
    assert_same_update(one, many)
    for key in ("loss/ppo", "loss/clipfrac", "loss/approx_kl", "loss/behav_weight_mean"):
        assert s_one[key] == pytest.approx(s_many[key], abs=1e-6)
    for key in ("loss/n_valid_tokens", "loss/n_capped_tokens", "loss/behav_weight_max"):
        assert s_one[key] == pytest.approx(s_many[key], rel=1e-6)
    assert s_one["grad_norm"] == pytest.approx(s_many["grad_norm"], rel=1e-5)


# ---------------------------------------------------------------- (c) proximal log-probs


def test_proximal_logprobs_equal_backend_logprobs(model_dir, trajectories) -> None:
    backend = make_backend(model_dir)
    seqs = [t.prompt_ids + t.output_ids for t in trajectories["own"]]
    prox = proximal_logprobs(backend, seqs, SMALL_BUDGET)
    assert len(backend.calls) >= 3  # computed over several micro-batches
    whole = backend.logprobs(seqs).detach().split([len(s) - 1 for s in seqs])
    assert len(prox) == len(seqs)
    for seq, p, w in zip(seqs, prox, whole, strict=True):
        assert p.shape == (len(seq) - 1,)
        assert not p.requires_grad
        assert torch.allclose(p, w, atol=1e-5, rtol=0)


def test_every_minibatch_uses_the_proximal_logprobs_of_the_step_start(
    model_dir, trajectories, monkeypatch
) -> None:
    """pi_prox is fixed for the whole step: the second minibatch, run after the first update,
    still sees the log-probs of the weights at the start of the step."""
    trajs = trajectories["perturbed"]
    seqs = [t.prompt_ids + t.output_ids for t in trajs]
    start = proximal_logprobs(make_backend(model_dir), seqs, BIG_BUDGET)
    backend = make_backend(model_dir)
    seen = []
    real_loss = ppo_mod.policy_loss

    def recording_loss(logprobs, prox, behav, adv, mask, *args, **kw):
        mb_seqs = backend.calls[-1]
        seen.append((logprobs.detach(), prox, mask, [seqs.index(s) for s in mb_seqs]))
        return real_loss(logprobs, prox, behav, adv, mask, *args, **kw)

    monkeypatch.setattr(ppo_mod, "policy_loss", recording_loss)
    train_step(backend, trajs, **step_args(n_minibatches=2, max_tokens_per_mb=BIG_BUDGET))
    assert len(seen) == 2  # one micro-batch per minibatch
    assert sorted(i for *_, idx in seen for i in idx) == list(range(len(trajs)))
    for k, (logprobs, prox, mask, idx) in enumerate(seen):
        expected = torch.cat([start[i] for i in idx])
        on = mask.bool()
        assert torch.allclose(prox[on], expected[on], atol=1e-5, rtol=0)
        assert (prox[~on] == 0).all()
        drift = (logprobs[on] - prox[on]).abs().max().item()
        if k == 0:
            assert drift < 1e-5  # theta == prox before the first update
        else:
            assert drift > 1e-3  # the first update moved theta, not prox


def test_entropy_stream_is_the_entropy_of_each_predicted_distribution(model_dir) -> None:
    backend = make_backend(model_dir)
    backend.temperature = 0.7
    seqs = [[5, 9, 14, 3, 22, 7], [40, 2, 2, 8]]
    lp, ent = backend.logprobs(seqs, [2, 1], with_entropy=True)
    assert torch.equal(lp, backend.logprobs(seqs, [2, 1]))
    expected = []
    for seq, start in zip(seqs, [2, 1], strict=True):
        with torch.no_grad():
            logits = backend.model(input_ids=torch.tensor([seq])).logits[0, :-1].float() / 0.7
        logp = torch.log_softmax(logits, -1)
        h = -(logp.exp() * logp).sum(-1)
        h[:start] = 0  # entries before the start are not computed
        expected.append(h)
    assert torch.allclose(ent, torch.cat(expected), atol=1e-5)
    ent.sum().backward()  # the entropy bonus trains through it
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in backend.model.parameters())


def test_entropy_bonus_and_reference_kl_in_train_step(model_dir, trajectories) -> None:
    ref = make_backend(model_dir)
    _, base = run_step(model_dir, trajectories["perturbed"])
    _, stats = run_step(
        model_dir, trajectories["perturbed"], entropy_coef=0.01, kl_coef=0.1, ref=ref
    )
    assert stats["loss/entropy"] > 0
    # The first minibatch's theta is the initial model, the reference: KL 0 there.
    assert stats["loss/kl_ref"] == pytest.approx(0.0, abs=1e-6)
    assert stats["time/reference_s"] > 0
    assert stats["loss/ppo"] != base["loss/ppo"]


@pytest.mark.parametrize("n_minibatches", [1, 2])
def test_first_minibatch_forward_serves_as_the_proximal_pass(
    model_dir, trajectories, n_minibatches
) -> None:
    """Without a cap the first minibatch's own forward gives its proximal log-probs: the
    same update and statistics as a separate proximal pass (forced here by a cap no weight
    reaches), one forward fewer for that minibatch's sequences."""
    trajs = [
        Trajectory(**{**vars(t), "versions": [3] * len(t.output_ids)})
        for t in trajectories["perturbed"]
    ]
    common = dict(n_minibatches=n_minibatches, max_tokens_per_mb=SMALL_BUDGET, version=3)
    reused, s_reused = run_step(model_dir, trajs, **common)
    separate, s_separate = run_step(model_dir, trajs, behav_imp_weight_cap=1e30, **common)
    forwards = lambda b: sum(len(call) for call in b.calls)  # noqa: E731
    first = len(trajs) // n_minibatches
    assert forwards(separate) - forwards(reused) == first
    assert_same_update(reused, separate)
    assert s_reused.keys() == s_separate.keys()
    for key, value in s_separate.items():
        assert s_reused[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    assert s_reused["train/fresh_tokens"] == sum(len(t.output_ids) for t in trajs)
    largest = max(n.abs().max().item() for n in trajectories["noise"])
    assert s_reused["train/fresh_logprob_diff_max"] == pytest.approx(largest, abs=1e-4)


# ---------------------------------------------------------------- (d) naive == decoupled


def test_naive_equals_decoupled_when_behaviour_is_the_model(model_dir, trajectories) -> None:
    trajs = trajectories["own"]
    dec, s_dec = run_step(model_dir, trajs, use_decoupled_loss=True, n_minibatches=2)
    naive, s_naive = run_step(model_dir, trajs, use_decoupled_loss=False, n_minibatches=2)
    assert len(dec.calls) == len(naive.calls) + 1  # only decoupled runs a proximal forward
    assert_same_update(dec, naive)
    for key in ("loss/ppo", "loss/clipfrac", "loss/approx_kl", "loss/behav_weight_mean"):
        assert s_dec[key] == pytest.approx(s_naive[key], abs=1e-5)


def test_naive_differs_from_decoupled_when_behaviour_is_stale(model_dir, trajectories) -> None:
    trajs = trajectories["perturbed"]
    dec, s_dec = run_step(model_dir, trajs, use_decoupled_loss=True)
    naive, s_naive = run_step(model_dir, trajs, use_decoupled_loss=False)
    # naive PPO: prox = behav, so the weight is exactly 1 and theta starts away from prox
    assert s_naive["loss/behav_weight_mean"] == 1.0
    assert s_naive["loss/approx_kl"] > 1e-3
    # decoupled: theta == prox at the start, the staleness is in the behaviour weight
    assert s_dec["loss/approx_kl"] == pytest.approx(0.0, abs=1e-6)
    assert s_dec["loss/clipfrac"] == 0.0
    assert s_dec["loss/behav_weight_mean"] != pytest.approx(1.0, abs=1e-2)
    assert max_abs_diff(dec.grads[0], naive.grads[0]) > 1e-4


# ---------------------------------------------------------------- (e) statistics


STAT_KEYS = ("loss/ppo", "loss/clipfrac", "loss/approx_kl", "grad_norm", "reward/mean")


@pytest.mark.parametrize("variant", ["own", "perturbed"])
@pytest.mark.parametrize("n_minibatches", [1, 2])
def test_train_step_stats_are_finite(model_dir, trajectories, variant, n_minibatches) -> None:
    trajs = trajectories[variant]
    backend, stats = run_step(
        model_dir,
        trajs,
        n_minibatches=n_minibatches,
        behav_imp_weight_cap=5.0,
        max_tokens_per_mb=SMALL_BUDGET,
    )
    assert set(STAT_KEYS) <= stats.keys()
    assert all(math.isfinite(v) for v in stats.values())
    assert len(backend.grads) == n_minibatches
    assert stats["grad_norm"] > 0
    assert 0.0 <= stats["loss/clipfrac"] <= 1.0
    assert stats["loss/approx_kl"] >= 0.0
    assert stats["reward/mean"] == pytest.approx(1.25)  # (5 * 5 - 3 * 5) / 8
    n_out = sum(len(t.output_ids) for t in trajs)
    assert stats["train/n_tokens"] == n_out
    assert stats["loss/n_valid_tokens"] + stats["loss/n_capped_tokens"] == n_out


def test_first_step_stats_at_the_proximal_policy(model_dir, trajectories) -> None:
    """One minibatch, behaviour = the model: u = w = 1 on every token, so the loss is
    -sum(A_i * n_out_i) / sum(n_out_i), nothing is clipped and the KL is 0."""
    trajs = trajectories["own"]
    backend, stats = run_step(model_dir, trajs)
    adv = compute_advantages(torch.tensor(REWARDS))
    n_out = torch.tensor([float(len(t.output_ids)) for t in trajs])
    expected = -(adv * n_out).sum().item() / n_out.sum().item()
    assert stats["loss/ppo"] == pytest.approx(expected, abs=1e-5)
    assert stats["loss/clipfrac"] == 0.0
    assert stats["loss/approx_kl"] == pytest.approx(0.0, abs=1e-6)
    assert stats["loss/behav_weight_mean"] == pytest.approx(1.0, abs=1e-5)
    assert stats["loss/n_valid_tokens"] == n_out.sum().item()
    # grad_norm is the norm of the gradient the optimizer saw
    norm = torch.sqrt(sum((g.double() ** 2).sum() for g in backend.grads[0])).item()
    assert stats["grad_norm"] == pytest.approx(norm, rel=1e-5)


def test_group_advantages_in_train_step(model_dir, trajectories) -> None:
    trajs = trajectories["own"]
    _, stats = run_step(model_dir, trajs, adv_norm="group")
    # groups of two: {5, -5} -> {1, -1}; {-5, 5} -> {-1, 1}; {5, 5} -> {0, 0}; {-5, 5}
    adv = [1.0, -1.0, -1.0, 1.0, 0.0, 0.0, -1.0, 1.0]
    n_out = [len(t.output_ids) for t in trajs]
    expected = -sum(a * n for a, n in zip(adv, n_out, strict=True)) / sum(n_out)
    assert stats["loss/ppo"] == pytest.approx(expected, abs=1e-5)


def test_cap_counts_tokens_whose_behaviour_weight_exceeds_it(model_dir, trajectories) -> None:
    trajs = trajectories["perturbed"]
    cap = 1.3
    _, stats = run_step(model_dir, trajs, behav_imp_weight_cap=cap)
    # behav = own + noise, so w = pi_prox / pi_behav = exp(-noise)
    weights = torch.exp(-torch.cat(trajectories["noise"]))
    n_capped = int((weights > cap).sum())
    assert 0 < n_capped < len(weights)
    assert stats["loss/n_capped_tokens"] == n_capped
    assert stats["loss/n_valid_tokens"] == len(weights) - n_capped
    assert stats["loss/behav_weight_max"] <= cap
    assert stats["loss/behav_masked_tokens"] == n_capped
    assert stats["loss/behav_masked_seqs"] == sum(
        bool((torch.exp(-n) > cap).any()) for n in trajectories["noise"]
    )


def test_sequence_mask_and_truncation_in_train_step(model_dir, trajectories) -> None:
    """MIS drops whole sequences whose product of weights exceeds the cap, counted as such;
    TIS keeps every token and counts those whose weight it clamped, through the trainer."""
    trajs, noise = trajectories["perturbed"], trajectories["noise"]
    products = [math.exp(-float(n.sum())) for n in noise]  # w = exp(-noise) per token
    ordered = sorted(products)  # a cap halfway between two products: half exceed it
    cap = (ordered[len(ordered) // 2 - 1] + ordered[len(ordered) // 2]) / 2
    over = [p > cap for p in products]
    assert 0 < sum(over) < len(over)
    _, stats = run_step(model_dir, trajs, recipe="mis", behav_imp_weight_cap=cap, n_minibatches=2)
    dropped = sum(len(n) for n, o in zip(noise, over, strict=True) if o)
    assert (stats["loss/behav_masked_seqs"], stats["loss/behav_masked_tokens"]) == (
        sum(over), dropped
    )  # fmt: skip
    assert stats["loss/n_valid_tokens"] == sum(len(n) for n in noise) - dropped
    # TIS at the token level, cap 1.1: nothing masked, the weights above it clamped.
    _, stats = run_step(model_dir, trajs, recipe="tis", behav_imp_weight_cap=1.1, n_minibatches=2)
    weights = torch.exp(-torch.cat(noise))
    assert stats["loss/behav_truncated_tokens"] == int((weights > 1.1).sum()) > 0
    assert stats["loss/behav_truncated_seqs"] == sum(
        bool((torch.exp(-n) > 1.1).any()) for n in noise
    )
    assert stats["loss/n_valid_tokens"] == len(weights)
    assert stats["loss/behav_weight_max"] <= 1.1 + 1e-6


# ---------------------------------------------------------------- fresh tokens' check


def test_fresh_tokens_check_finds_log_probs_the_current_weights_do_not_give(
    model_dir, trajectories
):
    """Tokens tagged with the trainer's version: behaviour = proximal log-prob, else a gap."""
    own, perturbed = trajectories["own"], trajectories["perturbed"]
    # Version 3 is the trainer's: own log-probs are what its weights give, exactly.
    fresh = [
        Trajectory(**{**vars(t), "versions": [3] * len(t.output_ids)}) for t in own[:4]
    ] + perturbed[4:]  # versions 0: stale, perturbed log-probs are not checked
    _, stats = run_step(model_dir, fresh, version=3)
    assert stats["train/fresh_tokens"] == sum(len(t.output_ids) for t in own[:4])
    assert stats["train/fresh_logprob_diff_max"] < 1e-5  # short answers, float32: ~1e-6
    # The same tokens with perturbed log-probs: the gap is the largest perturbation.
    tagged = [Trajectory(**{**vars(t), "versions": [3] * len(t.output_ids)}) for t in perturbed[:4]]
    _, stats = run_step(model_dir, tagged + perturbed[4:], version=3)
    largest = max(n.abs().max().item() for n in trajectories["noise"][:4])
    assert stats["train/fresh_logprob_diff_max"] == pytest.approx(largest, abs=1e-4)
    # Without the trainer's version there is nothing to check.
    _, stats = run_step(model_dir, fresh)
    assert "train/fresh_tokens" not in stats
