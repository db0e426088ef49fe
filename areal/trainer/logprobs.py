"""Next-token log-probs from logits: log_softmax(logits / temperature)[label], per row.

The logits of a packed update are [tokens, vocabulary]: for a 1.5B Qwen2 at 16k tokens,
2.5G entries, 5 GB in bf16. Written as `log_softmax(logits.float() / t).gather(...)`, each
of the float copy, the division, the softmax's passes and their backward reads and writes
the whole fp32 tensor (10 GB): about 60 ms of an H200's 466 ms update, and 30 GB of
temporaries. Here the work is two reductions over the logits as they are (their max, then
the sum of exponentials with the label's entry picked in the same pass), compiled into one
kernel each on a GPU (torch.compile; TORCHDYNAMO_DISABLE=1 runs them eagerly), and the
backward is one pass that writes the gradient in the logits' dtype. On a CPU the same code
runs eagerly (compiling costs more than it saves on the small models trained there).

Vocab-parallel logits (Megatron's tensor parallelism: each rank holds a slice of the
vocabulary) reduce the max and the two sums over the tensor-parallel group; every rank
then holds the same log-probs, and each slice's gradient is its own part of the softmax's.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.distributed as dist

# Rows per compiled call: a chunk of logits stays under 2^31 entries (int32 indexing) and
# its fp32 temporaries, if any, bounded.
CHUNK_ENTRIES = 2**30


def _max(logits: torch.Tensor, n_real: int) -> torch.Tensor:
    return logits[:, :n_real].amax(-1).float()


def _sums(
    logits: torch.Tensor, labels: torch.Tensor, shift: torch.Tensor, temperature: float, n_real: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of exp(z), z at the label or 0 if the label is not in this slice) per row, with
    z = logits / temperature - shift over the n_real real columns (the rest is padding)."""
    z = logits.float() / temperature - shift[:, None]
    if n_real < logits.shape[-1]:
        z = z.masked_fill(torch.arange(z.shape[-1], device=z.device) >= n_real, float("-inf"))
    mine = (labels >= 0) & (labels < n_real)
    picked = z.gather(1, labels.clamp(0, n_real - 1)[:, None])[:, 0]
    return z.exp().sum(-1), torch.where(mine, picked, 0.0)


@functools.cache
def _compiled(fn: Callable) -> Callable:
    return torch.compile(fn, dynamic=True)


def token_logprobs(
    logits: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    *,
    vocab_start: int = 0,
    n_real: int | None = None,
    tensor_parallel: bool = False,
    fused: bool | None = None,
) -> torch.Tensor:
    """fp32 [N]: log_softmax(logits / temperature)[i, labels[i]] for logits [N, V].

    With tensor_parallel, logits are this rank's vocabulary slice [vocab_start,
    vocab_start + V) of Megatron's tensor-parallel group; n_real of its columns are real
    tokens (the rest pads the vocabulary to a multiple of the group's size). fused:
    compiled (torch.compile); None = on a GPU.
    """
    n_real = logits.shape[-1] if n_real is None else n_real
    labels = labels - vocab_start
    fused = logits.is_cuda if fused is None else fused
    maxes, sums = (_compiled(_max), _compiled(_sums)) if fused else (_max, _sums)
    if tensor_parallel:
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel.mappings import (
            reduce_from_tensor_model_parallel_region as reduce_sum,
        )

        group = parallel_state.get_tensor_model_parallel_group()
    rows = max(1, CHUNK_ENTRIES // logits.shape[-1])
    out = []
    for lg, lb in zip(logits.split(rows), labels.split(rows), strict=True):
        with torch.no_grad():  # any shift gives the same log-probs: no gradient through it
            shift = maxes(lg, n_real) / temperature
            if tensor_parallel:
                dist.all_reduce(shift, op=dist.ReduceOp.MAX, group=group)
        sum_exp, picked = sums(lg, lb, shift, temperature, n_real)
        if tensor_parallel:
            # Forward: the sum over the slices; backward: each slice's own gradient.
            sum_exp, picked = reduce_sum(sum_exp), reduce_sum(picked)
        out.append(picked - sum_exp.log())
    return torch.cat(out) if len(out) > 1 else out[0]


def token_entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """fp32 [N]: the entropy of softmax(logits / temperature) per row of logits [N, V]
    (the entropy bonus), in chunks of rows so that the fp32 copy stays bounded."""
    rows = max(1, CHUNK_ENTRIES // logits.shape[-1])
    out = []
    for lg in logits.split(rows):
        logp = torch.log_softmax(lg.float() / temperature, -1)
        out.append(-(logp.exp() * logp).sum(-1))
    return torch.cat(out) if len(out) > 1 else out[0]
