"""Packed attention without a [T, T] mask (areal/trainer/packed_attention.py): the packed
forward equals per-sequence forwards, whether its sequences run in runs of equal lengths or
in padded buckets, and no tensor of the packed stream's square exists."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM

from areal.models.tiny import make_tiny_model
from areal.trainer import packed_attention
from areal.trainer.batching import pack_sequences
from areal.trainer.optimizer import OptimizerSpec
from areal.trainer.packed_attention import ATTN_IMPLEMENTATION
from areal.trainer.torch_backend import TorchBackend


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", warmup_steps=0)


def make_backend(model_dir) -> TorchBackend:
    optimizer = OptimizerSpec(
        lr=1e-3, weight_decay=0.0, betas=(0.9, 0.999), adam_eps=1e-8, grad_clip=1.0, warmup_steps=0
    )
    return TorchBackend.from_dir(model_dir, optimizer=optimizer, device="cpu")


def random_seqs(vocab: int, lens: list[int], seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(vocab, (n,), generator=gen).tolist() for n in lens]


def per_sequence_logprobs(model, seqs: list[list[int]]) -> torch.Tensor:
    """The reference stream: each token's log-prob after the first, one sequence per forward."""
    parts = []
    for seq in seqs:
        logits = model(input_ids=torch.tensor([seq])).logits[0, :-1]
        lp = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(seq[1:])[:, None])
        parts.append(lp[:, 0])
    return torch.cat(parts)


def test_packed_logprobs_and_grads_equal_per_sequence_forwards(model_dir) -> None:
    backend = make_backend(model_dir)
    assert backend.model.config._attn_implementation == ATTN_IMPLEMENTATION
    # The reference is transformers' own SDPA model, one sequence per forward.
    ref_model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa")
    # Very different lengths, a 1-token one, and runs of equal neighbours (one batched call).
    lens = [700, 2, 45, 45, 45, 1, 3, 260, 9, 9]
    seqs = random_seqs(ref_model.config.vocab_size, lens)
    weights = torch.randn(sum(n - 1 for n in lens), generator=torch.Generator().manual_seed(1))

    stream = backend.logprobs(seqs)
    (stream * weights).sum().backward()

    ref = per_sequence_logprobs(ref_model, seqs)
    (ref * weights).sum().backward()

    assert stream.shape == ref.shape
    torch.testing.assert_close(stream, ref, atol=1e-5, rtol=0)
    named_ref = dict(ref_model.named_parameters())
    for name, p in backend.model.named_parameters():
        torch.testing.assert_close(p.grad, named_ref[name].grad, atol=1e-5, rtol=1e-4, msg=name)


def test_starts_skip_the_prompt_logits_and_change_nothing_after_them(model_dir) -> None:
    """logprobs(seqs, starts): entries before starts[i] are 0, those after equal the full
    stream's, and so do the gradients of a loss over them."""
    lens, starts = [40, 7, 7, 25], [30, 0, 6, 3]
    seqs = random_seqs(300, lens, seed=2)
    scored = torch.cat([torch.arange(n - 1) >= s for n, s in zip(lens, starts, strict=True)])
    weights = torch.randn(int(scored.sum()), generator=torch.Generator().manual_seed(3))
    streams, grads = [], []
    for arg in (None, starts):
        backend = make_backend(model_dir)
        stream = backend.logprobs(seqs, arg)
        (stream[scored] * weights).sum().backward()
        streams.append(stream.detach())
        grads.append([p.grad for p in backend.model.parameters()])
    full, skipped = streams
    assert (skipped[~scored] == 0).all()
    torch.testing.assert_close(skipped[scored], full[scored], atol=1e-6, rtol=0)
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-5)


def test_position_ids_alone_and_padding_masks_give_the_same_attention(model_dir) -> None:
    """Without cu_seq_lens_q the boundaries come from the position ids; with a padding mask
    transformers' SDPA runs. Both must match the packed forward."""
    model = make_backend(model_dir).model
    seqs = random_seqs(model.config.vocab_size, [30, 5, 17])
    input_ids, position_ids, cu_seqlens = pack_sequences(seqs)
    with torch.no_grad():
        by_cu = model(input_ids[None], position_ids=position_ids[None], cu_seq_lens_q=cu_seqlens)
        by_pos = model(input_ids[None], position_ids=position_ids[None])
        torch.testing.assert_close(by_pos.logits, by_cu.logits, atol=1e-5, rtol=0)
        padded = torch.zeros(len(seqs), 30, dtype=torch.int64)
        mask = torch.zeros_like(padded)
        for b, s in enumerate(seqs):
            padded[b, : len(s)], mask[b, : len(s)] = torch.tensor(s), 1
        logits = model(padded, attention_mask=mask).logits
    rows = by_cu.logits[0].split([len(s) for s in seqs])
    for b, row in enumerate(rows):
        torch.testing.assert_close(logits[b, : len(row)], row, atol=1e-5, rtol=0)


class LargestTensor(TorchDispatchMode):
    """Records the element count of the largest tensor any aten op returns."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
        return out


def test_packed_forward_and_backward_build_nothing_of_size_t_squared(model_dir) -> None:
    """4 sequences of 4k tokens: a [T, T] mask would hold 2^28 elements (and SDPA's float
    version of it 1 GiB); the per-sequence path's largest tensor is far below one
    sequence's L^2."""
    backend = make_backend(model_dir)
    length, n = 4096, 4
    seqs = random_seqs(backend.model.config.vocab_size, [length] * n)
    with LargestTensor() as largest:
        stream = backend.logprobs(seqs)
        stream.sum().backward()
    assert stream.shape == (n * (length - 1),)
    assert torch.isfinite(stream).all()
    assert largest.numel < length * length, largest.numel


# ---- runs and padded buckets ----------------------------------------------------------

RUNS_ONLY = packed_attention.AttentionCost(bucket=1e12)  # never pads
BUCKETS = packed_attention.AttentionCost(call=1e12)  # pads as much as a bucket may hold


def reference_attention(q, k, v, lens):
    """Each sequence alone through stock causal SDPA: [1, H, T, D] -> [1, T, H, D]."""
    gqa = q.shape[1] != k.shape[1]
    parts = [
        F.scaled_dot_product_attention(a, b, c, is_causal=True, enable_gqa=gqa)
        for a, b, c in zip(q.split(lens, 2), k.split(lens, 2), v.split(lens, 2), strict=True)
    ]
    return torch.cat(parts, 2).transpose(1, 2)


def qkv(lens, heads, kv_heads, dim=16, seed=0):
    """q/k/v in transformers' layout: [1, T, H, D] in memory, seen as [1, H, T, D]."""
    gen = torch.Generator().manual_seed(seed)
    t = sum(lens)
    return [
        torch.randn(1, t, h, dim, generator=gen, dtype=torch.float64, requires_grad=True)
        for h in (heads, kv_heads, kv_heads)
    ]


@pytest.mark.parametrize(
    "lens",
    [
        [84, 83, 83, 82, 80, 80, 80, 79],  # near-equal, sorted as the trainer's micro-batches
        [5, 300, 1, 40, 40, 41, 2, 2, 17, 90, 3],  # mixed, unsorted, 1-token ones
        [57],  # a single sequence
        [12, 0, 9, 9],  # an empty sequence holds no tokens
    ],
)
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (8, 2)])  # MHA and GQA
@pytest.mark.parametrize("cost", [BUCKETS, RUNS_ONLY, None], ids=["buckets", "runs", "model"])
def test_runs_and_buckets_equal_each_sequence_alone(lens, heads, kv_heads, cost) -> None:
    """Outputs and the gradients of q, k and v, whichever grouping the plan takes."""
    weights = torch.randn(1, sum(lens), heads, 16, dtype=torch.float64)

    def outputs_and_grads(attention):
        q, k, v = qkv(lens, heads, kv_heads)
        out = attention(*(x.transpose(1, 2) for x in (q, k, v)))
        (out * weights).sum().backward()
        return out.detach(), q.grad, k.grad, v.grad

    packed = outputs_and_grads(
        lambda q, k, v: packed_attention.causal_attention_packed(q, k, v, lens, cost=cost)
    )
    alone = outputs_and_grads(lambda q, k, v: reference_attention(q, k, v, lens))
    assert packed[0].shape == (1, sum(lens), heads, 16)
    for got, want in zip(packed, alone, strict=True):
        torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-10)


def test_forced_buckets_pad_and_runs_stay_views() -> None:
    lens = (9, 9, 7, 7, 7, 4, 1)
    (bucket,) = packed_attention.plan_groups(lens, 1.0, BUCKETS, "cpu")
    assert (bucket.n, bucket.length, bucket.n_tokens) == (7, 9, sum(lens))
    # Each sequence's rows, then its padding pointing at its own first row.
    assert bucket.index.view(7, 9)[2].tolist() == [18, 19, 20, 21, 22, 23, 24, 18, 18]
    assert bucket.keep.tolist()[:11] == [*range(9), 9, 10]
    assert len(bucket.keep) == sum(lens)
    runs = packed_attention.plan_groups(lens, 1.0, RUNS_ONLY, "cpu")
    assert [(g.n, g.length, g.index) for g in runs] == [
        (2, 9, None),
        (3, 7, None),
        (1, 4, None),
        (1, 1, None),
    ]


def test_the_cost_model_pads_short_sequences_and_not_long_near_equal_ones() -> None:
    """The measured cases (the module's docstring): runs for 16 sequences of 80..88 tokens
    and for a long-tailed micro-batch, buckets for 64 distinct lengths of 10..73."""
    cost = packed_attention.COST

    def n_buckets(lens: list[int]) -> int:
        groups = packed_attention.plan_groups(tuple(lens), 1.0, cost, "cpu")
        assert sum(g.n_tokens for g in groups) == sum(lens)
        return sum(g.index is not None for g in groups)

    assert n_buckets([88, 88, 87, 86, 86, 85, 84, 84, 84, 83, 82, 82, 81, 80, 80, 80]) == 0
    assert n_buckets([1296, 700, 311, 250, 140, 90, 60, 45, 33]) == 0
    assert n_buckets(list(range(73, 9, -1))) > 0
    assert n_buckets([40] * 10) == 0  # one run: nothing to pad


@pytest.mark.parametrize(
    "cost, kinds",
    [
        # The tiny model's attention is narrow (4 heads x 16 dims: width 1/4), so the model's
        # own cost pads the short neighbours and keeps the 120- and 7-token ones as runs.
        (None, [True, True, False, False]),
        (BUCKETS, [True]),  # all in one bucket padded to 120
    ],
    ids=["model", "buckets"],
)
def test_bucketed_logprobs_and_grads_equal_per_sequence_forwards(
    model_dir, monkeypatch, cost, kinds
) -> None:
    """The whole model (GQA: 4 heads / 2 KV heads) through padded buckets."""
    if cost is not None:
        monkeypatch.setattr(packed_attention, "COST", cost)
    backend = make_backend(model_dir)
    ref_model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa")
    config = backend.model.config
    width = config.hidden_size / 256  # heads x head_dim / 256
    lens = [61, 60, 60, 58, 33, 31, 2, 1, 1, 120, 7]
    groups = packed_attention.plan_groups(tuple(lens), width, packed_attention.COST, "cpu")
    assert [g.index is not None for g in groups] == kinds
    seqs = random_seqs(config.vocab_size, lens, seed=4)
    weights = torch.randn(sum(n - 1 for n in lens), generator=torch.Generator().manual_seed(5))

    stream = backend.logprobs(seqs)
    (stream * weights).sum().backward()
    ref = per_sequence_logprobs(ref_model, seqs)
    (ref * weights).sum().backward()

    torch.testing.assert_close(stream, ref, atol=1e-5, rtol=0)
    named_ref = dict(ref_model.named_parameters())
    for name, p in backend.model.named_parameters():
        torch.testing.assert_close(p.grad, named_ref[name].grad, atol=1e-5, rtol=1e-4, msg=name)
