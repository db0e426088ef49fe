"""MegatronBackend: a backend.TrainerBackend over a megatron-core GPTModel.

    trainer/step.py --forward_backward(micro-batches, loss_fn)--> packed forwards
        --> per-token log-probs (TP-reduced, last PP stage) --> loss_fn --> backward
        --> reduce_grads(dp) --> optimizer_step()

Two paths behind one interface, chosen by what the machine has:

| piece      | CPU (tests, tiny runs)                 | GPU                                    |
|------------|----------------------------------------|----------------------------------------|
| layers     | local spec, SDPA per packed sequence   | TE spec, packed THD sequences (if TE)  |
| parameters | model.dtype                            | model.dtype (bf16) in Float16Module    |
| pp = 1     | batching.MicroBatchLoops' plain loops  | batching.MicroBatchLoops' plain loops  |
| pp > 1     | pipeline.gpipe (gloo send/recv)        | gpu.forward_backward_pipelined (1F1B)  |
| gradients  | DataParallel.all_reduce_grads (DP grp) | Megatron DDP, fp32 grad buffers        |
|            | + tied-embedding sum, first/last stage | (finalize_model_grads does both)       |
| optimizer  | torch AdamW, TP/PP-aware clip          | get_megatron_optimizer (fp32 master)   |
| checkpoint | each TP/PP rank its optimizer file     | same, Megatron's DP-sharded state      |
|            |                                        | gathered on DP rank 0 of each TP/PP    |

With pp > 1, results of the last stage (log-probs, loss statistics) are broadcast over the
pipeline group, so step.py sees the same values on every rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist

from areal.checkpoint import load_rank_state, save_rank_state
from areal.trainer.backend import DTYPES, optimizer_file
from areal.trainer.batching import LossFn, MicroBatchLoops, pack_sequences, scored_rows
from areal.trainer.logprobs import token_logprobs
from areal.trainer.megatron import cuda_redirect, pipeline
from areal.trainer.megatron.model import build_gpt_model, has_transformer_engine, read_hf_config
from areal.trainer.megatron.weights_io import hf_tensors, load_hf, save_hf
from areal.trainer.optimizer import OptimizerSpec
from areal.trainer.parallel import DataParallel, broadcast_plain


def init_model_parallel(tp: int, pp: int) -> None:
    """Megatron's TP/PP/DP groups over the current world (a world of one if there is none)."""
    from megatron.core import parallel_state as ps

    cuda_redirect.apply()
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(tp, pp)


def data_parallel_group(world: DataParallel) -> DataParallel:
    """`world` (parallel.DataParallel) with its reductions over Megatron's data-parallel
    group: gradients summed over replicas only; a replica is Megatron's model-parallel group
    (its head pulls the replica's share of a batch for all of it)."""
    from megatron.core import parallel_state as ps

    return world.replicas(
        ps.get_data_parallel_rank(),
        ps.get_data_parallel_world_size(),
        ps.get_data_parallel_group(),
        ps.get_model_parallel_group(),
    )


class MegatronBackend(MicroBatchLoops):
    """Owns this rank's model slice and optimizer (a backend.TrainerBackend); with one
    pipeline stage MicroBatchLoops' loops run its log-probs."""

    collective_save = True  # each rank holds a slice of the weights and of the optimizer

    def __init__(
        self,
        model_dir: str | Path,
        *,
        tp: int = 1,
        pp: int = 1,
        optimizer: OptimizerSpec,
        dtype: str = "float32",
        save_dtype: str = "bfloat16",
        temperature: float = 1.0,
        seed: int = 1,
        fused: bool = True,
    ):
        from megatron.core import parallel_state as ps

        self.model_dir = Path(model_dir)
        _, self.shape = read_hf_config(self.model_dir)
        init_model_parallel(tp, pp)
        cuda_redirect.seed(seed)
        self.tp, self.pp = tp, pp
        tp_rank, stage = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
        self.layout = (tp, tp_rank, pp, stage)
        self.on_gpu = torch.cuda.is_available()
        self.device = torch.device("cpu")
        if self.on_gpu:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.packed_thd = has_transformer_engine()
        # Fused elementwise kernels on a GPU (model.transformer_config); off for comparison.
        self.fused = fused and self.on_gpu
        self.gpt = build_gpt_model(self.shape, tp, pp, dtype, self.fused)
        load_hf(self.gpt, self.model_dir, self.shape, self.layout)
        self.temperature = temperature
        self.dtype, self.save_dtype = DTYPES[dtype], DTYPES[save_dtype]
        self.optimizer_spec, self.n_steps = optimizer, 0
        if self.on_gpu:
            from areal.trainer.megatron.gpu import wrap_for_gpu

            self.model, self.optimizer = wrap_for_gpu(self.gpt, dtype, optimizer)
        else:
            self.model = self.gpt
            self.optimizer = torch.optim.AdamW(self.gpt.parameters(), **optimizer.adamw_args())
        self._set_lr()

    # ---- forward ------------------------------------------------------------------------

    def packed_forward(
        self, seqs: Sequence[Sequence[int]], model: torch.nn.Module | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(model output [1, T, ...], token ids [T]) of the packed stream: the vocab-parallel
        logits on the last PP stage (in the parameters' dtype), hidden states elsewhere."""
        from areal.trainer.megatron.packed_attention import PackedStream

        input_ids, position_ids, cu_seqlens = pack_sequences(seqs)
        # non_blocking: a blocking copy to the GPU waits for all the work queued before it.
        input_ids, position_ids, cu = (
            x.to(self.device, non_blocking=True)
            for x in (input_ids, position_ids, cu_seqlens.to(torch.int32))
        )
        lengths = tuple(len(s) for s in seqs)
        if self.packed_thd:
            # TE's THD kernels; the rotary embedding restarts at each cu_seqlens boundary.
            layout, max_len = "thd", max(lengths)
        else:
            # The local spec's PackedDotProductAttention: causal SDPA per sequence, no mask.
            # Megatron sizes the rotary table by max_seqlen, and without THD it rotates the
            # stream by positions 0..T-1: RoPE is relative, so a sequence's attention is the
            # same as with its positions restarting at 0.
            layout, max_len = "sbhd", len(input_ids)
        packed = PackedStream(
            qkv_format=layout,
            cu_seqlens_q=cu,
            cu_seqlens_kv=cu,
            max_seqlen_q=max_len,
            max_seqlen_kv=max_len,
            lengths=lengths,
        )
        # Megatron's Float16Module would upcast the logits to fp32 (10 GB at 16k tokens of a
        # 152k vocabulary, and as much again for their gradient): token_logprobs does its
        # arithmetic in fp32 anyway, reading them as they are.
        half = {"fp32_output": False} if self.on_gpu and self.dtype != torch.float32 else {}
        model = model if model is not None else self.model
        output = model(input_ids[None], position_ids[None], None, packed_seq_params=packed, **half)
        return output, input_ids

    def _forward(self, seqs: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Vocab-parallel logits [T, V/tp] of the packed stream, and its token ids [T]."""
        # With pp > 1 only the last stage has logits: forward_backward schedules the stages.
        assert self.pp == 1, "logprobs/logits run one stage; with pp > 1 use forward_backward"
        output, input_ids = self.packed_forward(seqs)
        return output[0], input_ids

    def forward(
        self,
        micro_batches: Sequence[Sequence[Sequence[int]]],
        starts: Sequence[Sequence[int]] | None = None,
    ) -> list[torch.Tensor]:
        """Each micro-batch's log-prob stream on every rank (MicroBatchLoops.forward's
        contract); with pp > 1 through a pipeline schedule (see the module table)."""
        if self.pp == 1:
            return super().forward(micro_batches, starts)
        return self._pipelined(micro_batches, None, starts)

    def forward_backward(
        self,
        micro_batches: Sequence[Sequence[Sequence[int]]],
        loss_fn: LossFn,
        starts: Sequence[Sequence[int]] | None = None,
        with_entropy: bool = False,
    ) -> list[dict[str, float]]:
        """MicroBatchLoops.forward_backward's contract on every rank; with pp > 1 through a
        pipeline schedule (see the module table). No entropy: the vocab-parallel entropy
        is not built (the config refuses ppo.entropy_coef with this backend)."""
        if with_entropy:
            raise ValueError("the megatron backend does not compute entropies: entropy_coef=0")
        if self.pp == 1:
            return super().forward_backward(micro_batches, loss_fn, starts)
        return self._pipelined(micro_batches, loss_fn, starts)

    def _pipelined(
        self,
        micro_batches: Sequence[Sequence[Sequence[int]]],
        loss_fn: LossFn | None,
        starts: Sequence[Sequence[int]] | None,
    ) -> list:
        """The pipeline schedule's results (streams without loss_fn, else stats), computed
        on the last stage and broadcast to every stage of this pipeline."""
        if not micro_batches:  # the same on every stage of this pipeline: all skip
            return []
        if self.on_gpu:
            from areal.trainer.megatron.gpu import forward_backward_pipelined

            results = forward_backward_pipelined(self, micro_batches, loss_fn, starts)
        else:
            results = pipeline.gpipe(self, micro_batches, loss_fn, starts)
        return pipeline.broadcast_from_last_stage(
            results, micro_batches, loss_fn is None, self.device
        )

    def stream(
        self,
        seqs: Sequence[Sequence[int]],
        starts: Sequence[int] | None = None,
        with_entropy: bool = False,
    ) -> torch.Tensor:
        """MicroBatchLoops' packed forward (one stage): the log-prob stream (self.logprobs)."""
        return self.logprobs(seqs, starts, with_entropy)

    def logprobs(
        self,
        seqs: Sequence[Sequence[int]],
        starts: Sequence[int] | None = None,
        with_entropy: bool = False,
    ) -> torch.Tensor:
        """Log-probs of every next token of every sequence, as one stream (L-1 per sequence);
        entries before starts[i] are 0 (see token_logprobs). No entropy (forward_backward)."""
        if with_entropy:
            raise ValueError("the megatron backend does not compute entropies: entropy_coef=0")
        logits, input_ids = self._forward(seqs)
        return self.token_logprobs(logits[None], input_ids, seqs, starts)

    def token_logprobs(
        self,
        output: torch.Tensor,
        input_ids: torch.Tensor,
        seqs: Sequence[Sequence[int]],
        starts: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """Next-token log-probs from vocab-parallel logits [1, T, V/tp], reduced over TP.

        Every row goes through the softmax (the output layer has computed every row's
        logits: GPTModel keeps none back), and the unscored rows (before their sequence's
        start) are then set to 0. Selecting the scored rows first costs more on a GPU: a
        copy of the logits and its scatter-add in the backward. The row indices are made on
        the CPU: a boolean mask on the GPU would stall the host until the forward is done.
        """
        in_stream, scored = scored_rows(seqs, starts)
        per_rank = output.shape[-1]
        start = self.layout[1] * per_rank
        lp = token_logprobs(
            output[0],
            input_ids.roll(-1),  # the next token; a sequence's last row is not in the stream
            self.temperature,
            vocab_start=start,
            n_real=min(max(self.shape.vocab_size - start, 0), per_rank),
            tensor_parallel=self.tp > 1,
            fused=self.fused,
        )
        scored = scored.to(self.device, non_blocking=True)
        keep = in_stream.nonzero()[:, 0].to(self.device, non_blocking=True)
        return torch.where(scored, lp, 0.0)[keep]

    @torch.no_grad()
    def logits(self, seqs: Sequence[Sequence[int]]) -> torch.Tensor:
        """Full-vocabulary logits [T, V] of the packed stream (for checks against HF)."""
        from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

        logits, _ = self._forward(seqs)
        return gather_from_tensor_model_parallel_region(logits)[:, : self.shape.vocab_size].float()

    # ---- update -------------------------------------------------------------------------

    def reduce_grads(self, dp: DataParallel) -> None:
        """Sum gradients over the data-parallel group (the loss is already normalised), and
        the tied embedding's over its two copies (first and last PP stage)."""
        if self.on_gpu:
            from megatron.core.distributed import finalize_model_grads

            finalize_model_grads([self.model])
        else:
            dp.all_reduce_grads(self.gpt.parameters())
            self._sum_tied_embedding_grads()

    def _sum_tied_embedding_grads(self) -> None:
        """With tied embeddings and pp > 1, the last stage holds a copy of the embedding as
        its output layer (Megatron's design). Both copies must take the same update: the sum
        of their gradients, as Megatron's finalize_model_grads does on GPU."""
        from megatron.core import parallel_state as ps

        if self.pp == 1 or not self.shape.tie_word_embeddings:
            return
        if not ps.is_rank_in_embedding_group():
            return
        weight = self.gpt.shared_embedding_or_output_weight()
        if weight.grad is None:
            weight.grad = torch.zeros_like(weight)
        dist.all_reduce(weight.grad, group=ps.get_embedding_group())

    def _set_lr(self) -> None:
        lr = self.optimizer_spec.lr_at(self.n_steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def optimizer_step(self) -> float:
        """Clip, step, and reset gradients; returns the gradient norm before clipping."""
        if self.on_gpu:
            _, norm, _ = self.optimizer.step()
            self.model.zero_grad_buffer()
            self.optimizer.zero_grad()
        else:
            norm = clip_grad_norm(list(self.gpt.parameters()), self.optimizer_spec.grad_clip)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        self.n_steps += 1
        self._set_lr()
        return float(norm or 0.0)

    # ---- weights and state --------------------------------------------------------------

    def save_hf(self, out_dir: Path | None) -> None:
        """Write an HF directory at out_dir; every rank of the model-parallel group calls it
        (ranks other than global rank 0 pass None and only contribute their slices)."""
        save_hf(self.gpt, out_dir, self.shape, self.layout, self.model_dir, self.save_dtype)

    def hf_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """The HF-named tensors save_hf would write, on global rank 0 (empty elsewhere);
        every rank of the trainer world calls it together."""
        return list(hf_tensors(self.gpt, self.shape, self.layout))

    def state_dict(self) -> dict:
        """Global rank 0's part of the trainer state: the step count, and the layout that
        every model-parallel rank's optimizer file (save_optimizer) was written for."""
        return {"n_steps": self.n_steps, "tp": self.tp, "pp": self.pp}

    def load_state_dict(self, state: dict) -> None:
        """Refuse a different tp/pp than saved: the optimizer files are slices of that layout.

        (The weights would convert to any layout, but silently restarting Adam's moments
        and warm-up changes the run; starting afresh from the weights is the explicit way.)
        """
        saved = (state.get("tp"), state.get("pp"))
        if saved != (self.tp, self.pp):
            raise ValueError(
                f"the checkpoint was saved with trainer.parallel.tp={saved[0]}, pp={saved[1]} "
                f"but this run asks for tp={self.tp}, pp={self.pp}: its optimizer state is "
                "sliced for the saved layout. Resume with the saved tp and pp, or start a new "
                "run with model.path=<the checkpoint's model/ directory> (fresh optimizer)"
            )
        self.n_steps = state["n_steps"]
        self._set_lr()

    def _optimizer_file(self) -> str:
        return optimizer_file(self.layout[1], self.layout[3])

    def save_optimizer(self, directory: Path | None) -> None:
        """Every rank of the trainer world calls it together; global rank 0 passes the
        checkpoint directory (being written), the others None.

        Data-parallel rank 0 of each (tp, pp) position writes its own optimizer file there;
        on GPU, Megatron's distributed optimizer first gathers its DP-sharded state on it.
        Returns after every file is written (a barrier): the caller may then commit.
        """
        from megatron.core import parallel_state as ps

        directory = broadcast_plain(
            None if directory is None else str(directory), src=0, device=self.device
        )
        state = self._optimizer_state()
        if ps.get_data_parallel_rank() == 0:
            save_rank_state(Path(directory), self._optimizer_file(), state)
        dist.barrier()

    def load_optimizer(self, directory: Path) -> None:
        """This rank's optimizer file (every data-parallel replica reads its (tp, pp) one);
        collective on GPU (DP rank 0 scatters the sharded state). Call after load_state_dict."""
        state = load_rank_state(Path(directory), self._optimizer_file())
        if self.on_gpu:
            from areal.trainer.megatron.gpu import load_optimizer_state

            load_optimizer_state(self.optimizer, state)
        else:
            self.optimizer.load_state_dict(state["optimizer"])
        self._set_lr()

    def _optimizer_state(self) -> dict:
        if self.on_gpu:
            from areal.trainer.megatron.gpu import optimizer_state

            return optimizer_state(self.optimizer)
        return {"optimizer": self.optimizer.state_dict()}


def clip_grad_norm(params: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """Clip by the global norm of the full (unsharded) gradient across TP and PP ranks.

    A TP-split parameter contributes its slice on every TP rank; a replicated one (norms)
    only once, from TP rank 0, or the norm would count it tp times. Each PP stage adds its
    own layers; the last stage's copy of a tied embedding (`shared`, see
    MegatronBackend._sum_tied_embedding_grads) is left out, the first stage counts it.
    """
    from megatron.core import parallel_state as ps

    grads = [p.grad for p in params if p.grad is not None]
    tp_rank = ps.get_tensor_model_parallel_rank()
    sq = torch.zeros((), dtype=torch.float64)
    for p in params:
        if p.grad is None or getattr(p, "shared", False):
            continue
        if getattr(p, "tensor_model_parallel", False) or tp_rank == 0:
            sq += p.grad.detach().double().pow(2).sum().cpu()
    if ps.get_model_parallel_group().size() > 1:
        dist.all_reduce(sq, group=ps.get_model_parallel_group())
    norm = sq.sqrt().float()
    coef = max_norm / (norm + 1e-6)
    if coef < 1:
        for g in grads:
            g.mul_(coef)
    return norm
