"""Packed attention without a [T, T] mask (areal/trainer/packed_attention.py): the packed
forward equals per-sequence forwards, and no tensor of the packed stream's square exists."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM

from areal.models.tiny import make_tiny_model
from areal.trainer.batching import pack_sequences
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
    kw = dict(lr=1e-3, weight_decay=0.0, betas=(0.9, 0.999), adam_eps=1e-8, grad_clip=1.0)
    return TorchBackend(model_dir, warmup_steps=0, device="cpu", **kw)


def random_seqs(vocab: int, lens: list[int], seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(vocab, (n,), generator=gen).tolist() for n in lens]


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

    parts = []
    for seq in seqs:
        logits = ref_model(input_ids=torch.tensor([seq])).logits[0, :-1]
        lp = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(seq[1:])[:, None])
        parts.append(lp[:, 0])
    ref = torch.cat(parts)
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
