"""Pipeline parallelism (pp > 1) on the CPU: a GPipe schedule over torch.distributed
point-to-point (gloo), where Megatron's schedules cannot run (they hard-code CUDA).

    stage 0                 stage 1                    last stage
    embedding + layers --h[T,1,H]--> layers --h--> ... layers + head -> log-probs -> loss_fn
    1) forward of micro-batches 0..M-1 on every stage, keeping each one's graph
    2) backward of M-1..0: loss.backward() on the last stage; every other stage receives
       dL/dh of its output from the next stage and sends dL/dh of its input to the previous

| waits for                         | unblocked by                                 |
|-----------------------------------|----------------------------------------------|
| recv h of micro-batch k           | stage s-1 finishing the forward of k         |
| recv dL/dh of micro-batch k       | stage s+1 finishing the backward of k        |

Every rank holds the whole batch and the same micro-batches, so a receiving stage knows
T (the tokens of micro-batch k) and no shape is sent. TP ranks pair up with the same TP
rank of the next stage (Megatron's next/prev ranks): each sends the full hidden states.
GPipe keeps every micro-batch's activations until the backward: simple, and memory is
not what the CPU path is for. The results exist on the last stage only;
`broadcast_from_last_stage` hands them to the whole pipeline (rank 0, on stage 0, writes
the metrics; every stage needs the proximal log-probs).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist

from areal.trainer.batching import LossFn
from areal.trainer.parallel import broadcast_plain


class Stage(Protocol):
    """What the pipeline schedules (here and gpu.py) need of the megatron backend."""

    model: torch.nn.Module
    gpt: Any
    """The GPTModel of this rank's stage (set_input_tensor; config.pipeline_dtype)."""
    shape: Any
    """The model's shape (hidden_size)."""
    device: torch.device

    def packed_forward(
        self, seqs: Sequence[Sequence[int]], model: torch.nn.Module | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(output [1, T, ...], token ids [T]): logits on the last stage, hidden states else."""
        ...

    def token_logprobs(
        self,
        output: torch.Tensor,
        input_ids: torch.Tensor,
        seqs: Sequence[Sequence[int]],
        starts: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """The log-prob stream of the last stage's logits."""
        ...


def gpipe(
    backend: Stage,
    micro_batches: Sequence[Sequence[Sequence[int]]],
    loss_fn: LossFn | None,
    starts: Sequence[Sequence[int]] | None = None,
) -> list:
    """MicroBatchLoops.forward's (without loss_fn) or .forward_backward's contract over the
    pipeline stages: the results on the last stage, [] elsewhere."""
    from megatron.core import parallel_state as ps

    first, last = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
    prev = ps.get_pipeline_model_parallel_prev_rank()
    nxt = ps.get_pipeline_model_parallel_next_rank()
    train = loss_fn is not None
    hidden, dtype = backend.shape.hidden_size, backend.gpt.config.pipeline_dtype
    inputs, outputs, results = [], [], []
    # 1) forward, all micro-batches
    with torch.set_grad_enabled(train):
        for k, seqs in enumerate(micro_batches):
            h_in = None
            if not first:
                n_tokens = sum(len(s) for s in seqs)
                h_in = torch.empty(n_tokens, 1, hidden, dtype=dtype, device=backend.device)
                dist.recv(h_in, src=prev)
                h_in.requires_grad_(train)
            backend.gpt.set_input_tensor(h_in)
            out, input_ids = backend.packed_forward(seqs)  # h [T, 1, H] or logits
            if not last:
                dist.send(out.detach().contiguous(), dst=nxt)
            else:
                mb_starts = None if starts is None else starts[k]
                lp = backend.token_logprobs(out, input_ids, seqs, mb_starts)
                if train:
                    out, stats = loss_fn(k, lp)
                    results.append(stats)
                else:
                    results.append(lp.detach().float().cpu())
            inputs.append(h_in)
            outputs.append(out)
    backend.gpt.set_input_tensor(None)
    # 2) backward, in reverse: gradients accumulate in .grad as in the plain loop
    if train:
        for k in reversed(range(len(micro_batches))):
            grad = None
            if not last:
                grad = torch.empty_like(outputs[k])
                dist.recv(grad, src=nxt)
            torch.autograd.backward(outputs[k], grad)
            if not first:
                dist.send(inputs[k].grad.contiguous(), dst=prev)
    return results


def broadcast_from_last_stage(
    results: list,
    micro_batches: Sequence[Sequence[Sequence[int]]],
    forward_only: bool,
    device: torch.device,
) -> list:
    """The last stage's results on every stage of this pipeline.

    Log-prob streams travel as one float32 tensor whose length every stage knows (L-1
    per sequence); statistics as msgpack bytes (plain dicts of floats; nothing pickled).
    """
    from megatron.core import parallel_state as ps

    group = ps.get_pipeline_model_parallel_group()
    src = ps.get_pipeline_model_parallel_last_rank()
    if not forward_only:
        return broadcast_plain(results, src=src, group=group, device=device)
    sizes = [sum(len(s) - 1 for s in mb) for mb in micro_batches]
    if ps.is_pipeline_last_stage():
        flat = torch.cat(results).to(device) if results else torch.empty(0, device=device)
    else:
        flat = torch.empty(sum(sizes), dtype=torch.float32, device=device)
    dist.broadcast(flat, src=src, group=group)
    return list(flat.cpu().split(sizes))
