"""The GPU-only parts of the megatron backend: mixed precision and pipeline schedules.

    GPTModel (bf16 params) -> Float16Module -> Megatron DDP (fp32 grad buffers, summed over DP)
                           -> get_megatron_optimizer (fp32 master weights and Adam states)

As the paper trains: bf16 parameters, fp32 gradients and optimizer states. Megatron's
optimizer and schedules hard-code device="cuda" (shared/DEPENDENCIES.md), so none of this
runs on the CPU path; tests/system/test_megatron_gpu.py covers it where a GPU exists.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def wrap_for_gpu(gpt, dtype: str, grad_clip: float, *, lr, weight_decay, betas, eps):
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
        lr=lr,
        weight_decay=weight_decay,
        adam_beta1=betas[0],
        adam_beta2=betas[1],
        adam_eps=eps,
        clip_grad=grad_clip,
        bf16=dtype == "bfloat16",
        fp16=dtype == "float16",
        params_dtype=config.params_dtype,
        use_distributed_optimizer=True,
    )
    return model, get_megatron_optimizer(opt_config, [model])


def forward_backward_pipelined(
    backend,
    micro_batches: Sequence[Sequence[Sequence[int]]],
    loss_fn: Callable[[int, torch.Tensor], torch.Tensor],
    forward_only: bool = False,
) -> list[torch.Tensor]:
    """Run micro-batches through Megatron's pipeline schedule (1F1B for pp > 1).

    loss_fn(k, logprobs of micro-batch k) -> scalar loss; on the last stage the returned
    list holds each micro-batch's loss, elsewhere it is empty. Gradients accumulate as with
    the per-micro-batch loop; call backend.reduce_grads and optimizer_step afterwards.
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    batches = iter(enumerate(micro_batches))
    losses: list[torch.Tensor] = []

    def forward_step(data_iterator, model):
        k, seqs = next(data_iterator)
        logits, input_ids, kwargs = backend._packed_forward(seqs, model)

        def loss_func(output):
            lp = backend._token_logprobs(output, input_ids, seqs)
            loss = loss_fn(k, lp)
            losses.append(loss.detach())
            # (loss, number of tokens, reporting dict) with calculate_per_token_loss.
            return loss, torch.ones((), dtype=torch.int, device=loss.device), {}

        return logits, loss_func

    longest = max(sum(len(s) for s in mb) for mb in micro_batches)
    get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=batches,
        model=[backend.model],
        num_microbatches=len(micro_batches),
        seq_length=longest,
        micro_batch_size=1,
        forward_only=forward_only,
    )
    return losses
