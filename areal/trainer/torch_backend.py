"""The plain-torch trainer backend: a transformers causal LM trained on packed micro-batches.

Sequences of a micro-batch run as one padding-free token stream of T = sum(L_i) tokens:
every matrix product sees T rows and no padding. Attention must still keep the sequences
apart, and what that costs decides how large a micro-batch may be:

| attention                          | cost of a micro-batch    | used                     |
|------------------------------------|--------------------------|--------------------------|
| dense block-diagonal [T, T] mask   | T^2 memory and compute   | no longer (was on CPU)   |
| FlashAttention-2 varlen            | sum(L_i^2), memory ~ T   | when the model loads FA2 |
| SDPA per run of equal lengths or   | ~sum(L_i^2), memory ~ T  | otherwise (CPU, SDPA)    |
| padded bucket (packed_sdpa)        |                          |                          |

One PPO step of a 4M-parameter Qwen2 (benchmarks/trainer.py, 2-core CPU, medians of the
process's CPU time): 64 long-tailed sequences 1,820 tokens/s packed against 526 padded
(325 with the dense mask, measured earlier); 64 near-even ones (~20-token prompts, 64- or
128-token answers), where padding wastes 4% or 2% of the tokens, 2,232 against 2,183 and
2,271 against 2,238.

FlashAttention-2 finds the boundaries from the restarting position ids. Otherwise the
model's attention is set to packed_attention.ATTN_IMPLEMENTATION, which takes them as
`cu_seq_lens_q` and calls causal SDPA once per run of equal lengths or per padded bucket
of near-equal ones, as its cost model finds cheaper; see that module for the measurements
behind the choice. Both equal per-sequence forwards (tests/unit/test_step.py,
tests/unit/test_packed_attention.py).

`dtype` (model.dtype) is the compute dtype: the parameters, their gradients and Adam's
moments stay float32 (Adam on bfloat16 parameters would drop every update below their 3
significant digits) and the forward and backward run under torch.autocast to bfloat16 or
float16, as AMP does (float16 without AMP's loss scaling: prefer bfloat16). The published
and checkpointed weights are the float32 ones; a server in bfloat16 casts them as it
loads. On this repository's 2-core CPU (avx512_bf16, no AMX) bfloat16 trains the
4M-parameter model's 4,096-token batch 1.43x as fast.

With `lora` (model.lora) the base is frozen and held in the compute dtype (no float32
master copy: nothing updates it), LoRA layers wrap its linears (areal/lora.py) and the
optimizer holds the adapters' float32 parameters alone; save_hf writes the adapter
(adapter_model.safetensors + adapter_config.json), which is what a version and a
checkpoint's model/ hold.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, PreTrainedTokenizerBase
from transformers.utils import logging as hf_logging

from areal.checkpoint import load_rank_state, save_rank_state
from areal.lora import (
    LoRASpec,
    adapter_tensors,
    apply_lora,
    load_adapter_tensors,
    read_adapter,
    save_adapter,
)
from areal.trainer.backend import DTYPES, optimizer_file
from areal.trainer.batching import MicroBatchLoops, pack_sequences, scored_rows
from areal.trainer.logprobs import token_entropy, token_logprobs
from areal.trainer.optimizer import OptimizerSpec
from areal.trainer.packed_attention import ATTN_IMPLEMENTATION
from areal.trainer.parallel import DataParallel
from areal.weights import copy_companion_files


def rank_device(dp: DataParallel) -> str | None:
    """The device of a torch model of this rank: its GPU, or None (the classes' own choice)."""
    return str(dp.device) if dp.device.type == "cuda" else None


class TorchBackend(MicroBatchLoops):
    """Owns the model and optimizer; computes per-token log-probs and applies updates.
    A backend.TrainerBackend whose every rank holds the whole model; `forward` and
    `forward_backward` are MicroBatchLoops' over its log-probs."""

    collective_save = False  # global rank 0 holds all the weights and optimizer state

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        tokenizer: PreTrainedTokenizerBase | None = None,
        model_dir: str | Path | None = None,
        optimizer: OptimizerSpec,
        dtype: str = "float32",
        temperature: float = 1.0,
        device: str | None = None,
        lora: LoRASpec | None = None,
        adapter_dir: str | Path | None = None,
    ):
        """Train `model` (a transformers causal LM) in place, its parameters in float32.
        save_hf writes the tokenizer and generation files of model_dir beside the weights
        (from_dir), or else `tokenizer` when given. lora: train adapters only, starting
        from those of adapter_dir when given (a version or a checkpoint's model/)."""
        hf_logging.disable_progress_bar()  # one bar per published version would flood the log
        self.model_dir = None if model_dir is None else Path(model_dir)
        self.tokenizer = tokenizer
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.compute_dtype = DTYPES[dtype]
        self.lora = lora
        # A frozen base needs no float32 master copy: it is held in the compute dtype.
        base_dtype = self.compute_dtype if lora else torch.float32
        self.model = model.to(device=self.device, dtype=base_dtype)
        if lora:
            apply_lora(self.model, lora)
            if adapter_dir is not None:
                load_adapter_tensors(self.model, read_adapter(adapter_dir)[1])
        self.trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.temperature = temperature
        self.optimizer_spec, self.n_steps = optimizer, 0
        self.optimizer = torch.optim.AdamW(
            self.trainable,
            **optimizer.adamw_args(),
            # One kernel over all parameters instead of a loop of small ops: on CPU ~5x
            # faster for the tiny model, where the optimizer was a fifth of a step.
            fused=True,
        )
        self._set_lr()
        self._packed_by_position = self.model.config._attn_implementation == "flash_attention_2"
        if not self._packed_by_position:
            self.model.set_attn_implementation(ATTN_IMPLEMENTATION)

    @classmethod
    def from_dir(cls, model_dir: str | Path, **kwargs: Any) -> TorchBackend:
        """A backend over the HF model directory model_dir; kwargs as TorchBackend's."""
        # A LoRA run's frozen base is held in the compute dtype: read it so (no float32 peak).
        dtype = DTYPES[kwargs.get("dtype", "float32")] if kwargs.get("lora") else torch.float32
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
        return cls(model, model_dir=model_dir, **kwargs)

    def logprobs(
        self,
        seqs: Sequence[Sequence[int]],
        starts: Sequence[int] | None = None,
        with_entropy: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Log-probs of every next token of every sequence, as one stream.

        For a sequence of length L the stream holds L-1 entries: entry t is
        log p(token t+1 | tokens <= t) under logits / temperature. With `starts`, entries
        t < starts[i] are 0 and their logits are never computed (TRL's logits_to_keep does
        the same): the update reads only the predictions of generated tokens, and a logit
        row is vocabulary-sized, with its log-softmax, forward and backward (a tenth of a
        step of the 145k model with 25-token prompts and 32-token answers).
        with_entropy: also the entropy of each predicted distribution, as a second stream.
        """
        input_ids, position_ids, cu_seqlens = pack_sequences(seqs)
        in_stream, scored = scored_rows(seqs, starts)
        positions = scored.nonzero()[:, 0]
        # FA2 reads the boundaries from the position ids; packed_sdpa from cu_seq_lens_q.
        bounds = {} if self._packed_by_position else {"cu_seq_lens_q": cu_seqlens}
        with self._autocast():
            logits = self.model(
                input_ids=input_ids[None].to(self.device),
                position_ids=position_ids[None].to(self.device),
                logits_to_keep=positions.to(self.device),
                **bounds,
            ).logits[0]  # [scored, V]
        labels = input_ids[positions + 1].to(self.device)
        rows = positions.to(self.device)
        # Indices made on the CPU: a boolean mask on a GPU stalls the host (see megatron's).
        kept = in_stream.nonzero()[:, 0].to(self.device)

        def stream(values: torch.Tensor) -> torch.Tensor:
            every = torch.zeros(len(input_ids), dtype=values.dtype, device=self.device)
            return every.index_put((rows,), values)[kept]

        lp = stream(token_logprobs(logits, labels, self.temperature))
        if with_entropy:
            return lp, stream(token_entropy(logits, self.temperature))
        return lp

    @torch.no_grad()
    def logits(self, seqs: Sequence[Sequence[int]]) -> torch.Tensor:
        """Full-vocabulary logits [T, V] of the packed stream, without temperature."""
        input_ids, position_ids, cu_seqlens = pack_sequences(seqs)
        bounds = {} if self._packed_by_position else {"cu_seq_lens_q": cu_seqlens}
        with self._autocast():
            return self.model(
                input_ids=input_ids[None].to(self.device),
                position_ids=position_ids[None].to(self.device),
                **bounds,
            ).logits[0]

    def _autocast(self) -> torch.autocast:
        """The forward in the compute dtype (the backward follows it); off for float32."""
        on = self.compute_dtype != torch.float32
        return torch.autocast(self.device.type, dtype=self.compute_dtype, enabled=on)

    def stream(
        self,
        seqs: Sequence[Sequence[int]],
        starts: Sequence[int] | None = None,
        with_entropy: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """MicroBatchLoops' packed forward: the log-prob stream (self.logprobs)."""
        return self.logprobs(seqs, starts, with_entropy)

    def reduce_grads(self, dp: DataParallel) -> None:
        """Sum gradients over the data-parallel ranks (a no-op without them)."""
        dp.all_reduce_grads(self.trainable)

    def _set_lr(self) -> None:
        lr = self.optimizer_spec.lr_at(self.n_steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def optimizer_step(self) -> float:
        """Clip, step, and reset gradients; returns the gradient norm before clipping."""
        norm = torch.nn.utils.clip_grad_norm_(self.trainable, self.optimizer_spec.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.n_steps += 1
        self._set_lr()
        return float(norm)

    # ---- weights and state --------------------------------------------------------------

    def save_hf(self, out_dir: Path | None) -> None:
        """Write an HF model directory (safetensors, config, tokenizer) at out_dir; with
        LoRA the adapter alone (areal/lora.py's PEFT-format directory)."""
        assert out_dir is not None, "not a collective save: only global rank 0 calls it"
        out = Path(out_dir)
        if self.lora:
            save_adapter(self.model, out, self.lora, base_model=self.model_dir or "")
            return
        self.model.save_pretrained(out, safe_serialization=True)
        if self.model_dir is not None:
            copy_companion_files(self.model_dir, out)
        elif self.tokenizer is not None:
            self.tokenizer.save_pretrained(out)

    def hf_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """The model's tensors under their HF names (tied ones once), as save_hf writes them:
        with LoRA the adapter's alone (PEFT's names, float32, each layer's A then B)."""
        if self.lora:
            return list(adapter_tensors(self.model).items())
        seen: set[int] = set()
        out = []
        for name, t in self.model.state_dict().items():
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                out.append((name, t))
        return out

    def save_optimizer(self, directory: Path | None) -> None:
        """Adam's moments and step counts into the checkpoint directory (optimizer-tp0-pp0,
        the one model-parallel position); the learning-rate schedule is in state_dict."""
        assert directory is not None, "not a collective save: only global rank 0 calls it"
        save_rank_state(
            Path(directory), optimizer_file(), {"optimizer": self.optimizer.state_dict()}
        )

    def load_optimizer(self, directory: Path) -> None:
        """The optimizer state save_optimizer wrote (every rank reads the same file)."""
        state = load_rank_state(Path(directory), optimizer_file())
        self.optimizer.load_state_dict(state["optimizer"])
        self._set_lr()

    def state_dict(self) -> dict:
        """The optimizer steps taken: where the warm-up schedule stands."""
        return {"n_steps": self.n_steps, "lora_rank": self.lora.rank if self.lora else 0}

    def load_state_dict(self, state: dict) -> None:
        if "n_steps" not in state:
            raise ValueError(
                "this checkpoint's trainer.json has no n_steps: it was written by an older "
                "areal, whose torch optimizer state this one does not read. Start a new run "
                "with model.path=<the checkpoint's model/ directory> (fresh optimizer)"
            )
        rank = self.lora.rank if self.lora else 0
        if state.get("lora_rank", 0) != rank:
            raise ValueError(
                f"this checkpoint was trained with model.lora.rank={state.get('lora_rank', 0)}"
                f", this run has {rank}: resume with the same model.lora, or start a new run"
            )
        self.n_steps = state["n_steps"]
        self._set_lr()
