"""token_logprobs against log_softmax(...).gather, values and gradients; the compiled
path and the rotary embedding that replaces TE's on a GPU."""

from __future__ import annotations

import pytest
import torch

from areal.trainer import logprobs
from areal.trainer.logprobs import token_logprobs


def reference(logits: torch.Tensor, labels: torch.Tensor, temperature: float, n_real: int):
    z = logits[:, :n_real].float() / temperature
    return torch.log_softmax(z, -1).gather(1, labels[:, None])[:, 0]


def check(logits, labels, temperature=1.0, n_real=None, fused=False, atol=1e-5):
    n_real = logits.shape[-1] if n_real is None else n_real
    logits = logits.detach().requires_grad_()
    weights = torch.rand(len(labels), device=logits.device)  # a different gradient per row
    got = token_logprobs(logits, labels, temperature, n_real=n_real, fused=fused)
    (g_got,) = torch.autograd.grad((got * weights).sum(), logits)
    want = reference(logits, labels, temperature, n_real)
    (g_want,) = torch.autograd.grad((want * weights).sum(), logits)
    assert got.dtype == torch.float32 and g_got.dtype == logits.dtype
    torch.testing.assert_close(got, want, atol=atol, rtol=0)
    torch.testing.assert_close(g_got.float(), g_want.float(), atol=atol, rtol=0)
    assert not g_got[:, n_real:].any(), "padding columns have no gradient"


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_equal_to_log_softmax_with_temperature(temperature):
    g = torch.Generator().manual_seed(0)
    logits = 5 * torch.randn(33, 70, generator=g)
    check(logits, torch.randint(0, 70, (33,), generator=g), temperature)


def test_vocabulary_padding_is_no_token():
    """Columns past n_real (a vocabulary padded to a multiple of TP) take no probability,
    even where their logits are the largest."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(9, 64, generator=g)
    logits[:, 60:] = 50.0
    check(logits, torch.randint(0, 60, (9,), generator=g), n_real=60)


def test_rows_split_into_chunks_give_the_same(monkeypatch):
    g = torch.Generator().manual_seed(2)
    logits, labels = torch.randn(50, 40, generator=g), torch.randint(0, 40, (50,), generator=g)
    monkeypatch.setattr(logprobs, "CHUNK_ENTRIES", 7 * 40)  # 8 chunks, the last of 1 row
    check(logits, labels)
    check(logits[:0], labels[:0])  # no rows


def test_labels_outside_this_slice_pick_nothing():
    """A tensor-parallel rank holds a slice of the vocabulary; a label in another slice
    contributes 0 to this rank's picked logit (the group's sum adds the owner's)."""
    logits = torch.arange(10.0).repeat(3, 1)
    _, picked = logprobs._sums(logits, torch.tensor([-4, 3, 12]), torch.zeros(3), 1.0, 10)
    assert picked.tolist() == [0.0, 3.0, 0.0]


@pytest.mark.gpu
def test_compiled_on_cuda_in_bf16():
    g = torch.Generator().manual_seed(3)
    logits = (4 * torch.randn(300, 1000, generator=g)).bfloat16().cuda()
    labels = torch.randint(0, 990, (300,), generator=g).cuda()
    check(logits, labels, 0.7, n_real=990, fused=True, atol=2e-2)  # bf16 gradients


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_rotary_is_megatrons(device):
    """model.rotary (compiled on a GPU in place of TE's fused kernel) against Megatron's
    own eager rotary embedding, values and gradients."""
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    from areal.trainer.megatron.model import rotary

    g = torch.Generator().manual_seed(4)
    t = torch.randn(40, 1, 6, 32, generator=g).to(device).requires_grad_()
    for rot in (32, 16):  # all of the head, or part of it (the rest passes through)
        freqs = torch.randn(40, 1, 1, rot, generator=g).to(device)
        fn = torch.compile(rotary, dynamic=True) if device == "cuda" else rotary
        got, want = fn(t, freqs), _apply_rotary_pos_emb_bshd(t, freqs)
        w = torch.randn_like(want)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        (g_got,) = torch.autograd.grad((got * w).sum(), t)
        (g_want,) = torch.autograd.grad((want * w).sum(), t)
        torch.testing.assert_close(g_got, g_want, atol=1e-5, rtol=1e-5)
