"""The GPU-only parts of the megatron backend: mixed precision and pipeline schedules.

    GPTModel (bf16 params) -> Float16Module -> Megatron DDP (fp32 grad buffers, summed over DP)
                           -> get_megatron_optimizer (fp32 master weights and Adam states)

As the paper trains: bf16 parameters, fp32 gradients and optimizer states. Megatron's
optimizer and schedules hard-code device="cuda" (shared/DEPENDENCIES.md), so none of this
runs on the CPU path; tests/system/test_megatron_gpu.py covers it where a GPU exists.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from areal.trainer.batching import LossFn

if TYPE_CHECKING:
    from areal.trainer.megatron.pipeline import Stage
    from areal.trainer.optimizer import OptimizerSpec


def wrap_for_gpu(
    gpt: torch.nn.Module,
    dtype: str,
    optimizer: OptimizerSpec,
) -> tuple[torch.nn.Module, Any]:
    """(DDP-wrapped model, Megatron optimizer) for a GPTModel already on the GPU."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module

    config = gpt.config
    # The PPO loss is already divided by the valid tokens of the whole minibatch on all
    # ranks: gradients must be summed over DP, not averaged.
    config.calculate_per_token_loss = True
    # Packed micro-batches differ in length; pipeline stages then exchange shapes first.
    # (Megatron rejects variable lengths with the allgather MoE dispatcher, unused here.)
    config.moe_token_dispatcher_type = "alltoall"
    config.variable_seq_lengths = True
    module = Float16Module(config, gpt) if dtype != "float32" else gpt
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=True
    )
    model = DistributedDataParallel(config, ddp_config, module)
    opt_config = OptimizerConfig(
        optimizer="adam",
        lr=optimizer.lr,
        weight_decay=optimizer.weight_decay,
        adam_beta1=optimizer.betas[0],
        adam_beta2=optimizer.betas[1],
        adam_eps=optimizer.adam_eps,
        clip_grad=optimizer.grad_clip,
        bf16=dtype == "bfloat16",
        fp16=dtype == "float16",
        params_dtype=config.params_dtype,
        use_distributed_optimizer=True,
    )
    return model, get_megatron_optimizer(opt_config, [model])


def forward_backward_pipelined(
    backend: Stage,
    micro_batches: Sequence[Sequence[Sequence[int]]],
    loss_fn: LossFn | None = None,
    starts: Sequence[Sequence[int]] | None = None,
) -> list:
    """MicroBatchLoops.forward's (without loss_fn) or .forward_backward's contract through
    Megatron's pipeline schedule (1F1B).

    On the last stage: each micro-batch's log-prob stream without loss_fn (forward only),
    else loss_fn's stats; elsewhere []. Gradients accumulate as with the plain loop; call
    backend.reduce_grads (finalize_model_grads: DP and tied-embedding sums) afterwards.
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    batches = iter(enumerate(micro_batches))
    results: list = []

    def forward_step(data_iterator: Any, model: torch.nn.Module):
        k, seqs = next(data_iterator)
        output, input_ids = backend.packed_forward(seqs, model)

        def loss_func(logits: torch.Tensor):
            lp = backend.token_logprobs(
                logits, input_ids, seqs, None if starts is None else starts[k]
            )
            if loss_fn is None:
                results.append(lp.detach().float().cpu())
                loss = lp.float().sum() * 0.0
            else:
                loss, stats = loss_fn(k, lp)
                results.append(stats)
            # (loss, tokens, reports): with calculate_per_token_loss Megatron divides the
            # loss by nothing (loss_fn already normalises by the minibatch's valid tokens).
            return loss, torch.ones((), dtype=torch.int, device=loss.device), {}

        return output, loss_func

    longest = max(sum(len(s) for s in mb) for mb in micro_batches)
    get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=batches,
        model=[backend.model],
        num_microbatches=len(micro_batches),
        seq_length=longest,  # unused with variable_seq_lengths: stages exchange shapes
        micro_batch_size=1,
        forward_only=loss_fn is None,
    )
    return results


def _optimizers(optimizer: Any) -> list:
    """The distributed optimizers inside Megatron's (possibly chained) optimizer."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def optimizer_state(optimizer: Any) -> dict | None:
    """Megatron's optimizer state for a checkpoint, gathered on data-parallel rank 0.

    Collective over the DP group: the distributed optimizer shards Adam's moments and the
    fp32 master weights across DP ranks; get_parameter_state_dp_zero gathers them (None on
    the other ranks). state_dict() is the DP-independent rest (step, param groups).
    """
    params = [o.get_parameter_state_dp_zero() for o in _optimizers(optimizer)]
    if any(p is None for p in params):
        return None
    return {"optimizer": optimizer.state_dict(), "params": params}


def load_optimizer_state(optimizer: Any, state: dict) -> None:
    """The inverse of optimizer_state: DP rank 0's file is scattered over the DP group."""
    from megatron.core import parallel_state as ps

    optimizer.load_state_dict(state["optimizer"])
    is_dp0 = ps.get_data_parallel_rank() == 0
    for o, params in zip(_optimizers(optimizer), state["params"], strict=True):
        # With torch's AdamW (no TransformerEngine or apex), megatron-core 0.16 keeps a "step"
        # per parameter, restored by load_state_dict above; the scatter below carries the
        # weights and moments only but copies into every state key (KeyError: 'step', seen
        # on an H200). The steps stand aside while it copies.
        inner = o.optimizer.state
        steps = {p: s.pop("step") for p, s in inner.items() if "step" in s}
        try:
            o.load_parameter_state_from_dp_zero(params if is_dp0 else None)
        finally:
            for p, step in steps.items():
                inner[p]["step"] = step
