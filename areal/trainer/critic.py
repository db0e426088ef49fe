"""The critic of PPO with a critic (ppo.adv_estimator=gae): a value model and its optimizer,
trained on the same packed micro-batches as the policy (trainer/step.py).

    trunk: the transformer of critic.path (or the policy's initial weights), no LM head
    head:  a new linear layer hidden -> 1 on the final hidden state, zero at start (every
           value starts at 0, and the trunk's first gradients come from the head's growth)

A value stream is shaped like a log-prob stream (backend.TrainerBackend): L-1 entries per
sequence of length L, entry t the value V(tokens <= t) of the state in which token t+1 was
chosen, so that the token whose log-prob is entry t has its state's value at entry t too.

The plain-torch path only: the parameters and Adam in float32, the forward under autocast
to the compute dtype (as torch_backend.py); the same packed attention. Its checkpoint is
one file pair in the trainer's checkpoint directory (critic.safetensors + critic.json:
weights, head included, optimizer and steps), written and read beside the policy's.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from transformers import AutoModel
from transformers.utils import logging as hf_logging

from areal.checkpoint import load_rank_state, save_rank_state
from areal.trainer.backend import DTYPES
from areal.trainer.batching import MicroBatchLoops, pack_sequences, scored_rows
from areal.trainer.optimizer import OptimizerSpec
from areal.trainer.packed_attention import ATTN_IMPLEMENTATION
from areal.trainer.parallel import DataParallel

CHECKPOINT_NAME = "critic"
"""The critic's file pair in a checkpoint directory: critic.safetensors, critic.json."""


class ValueModel(torch.nn.Module):
    """A transformer trunk and a scalar head on its final (normed) hidden state."""

    def __init__(self, trunk: torch.nn.Module):
        super().__init__()
        self.trunk = trunk
        self.head = torch.nn.Linear(trunk.config.hidden_size, 1)
        # Zero at start: the advantages of the first step are the plain returns, and a
        # random head would add noise of the hidden state's scale to every one of them.
        torch.nn.init.zeros_(self.head.weight)
        torch.nn.init.zeros_(self.head.bias)


class TorchCritic(MicroBatchLoops):
    """A value model trained by Adam on packed micro-batches (forward / forward_backward /
    reduce_grads / optimizer_step, as a TrainerBackend's, with values in place of log-probs:
    MicroBatchLoops' over `values`)."""

    def __init__(
        self,
        trunk: torch.nn.Module,
        *,
        optimizer: OptimizerSpec,
        dtype: str = "float32",
        device: str | None = None,
    ):
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.compute_dtype = DTYPES[dtype]
        self.model = ValueModel(trunk).to(device=self.device, dtype=torch.float32)
        self._packed_by_position = trunk.config._attn_implementation == "flash_attention_2"
        if not self._packed_by_position:
            trunk.set_attn_implementation(ATTN_IMPLEMENTATION)
        self.params = list(self.model.parameters())
        self.optimizer_spec, self.n_steps = optimizer, 0
        self.optimizer = torch.optim.AdamW(self.params, **optimizer.adamw_args(), fused=True)
        self._set_lr()

    @classmethod
    def from_dir(cls, model_dir: str | Path, **kwargs) -> TorchCritic:
        """A critic whose trunk is the transformer of the HF directory model_dir (a causal
        LM's: its LM head is left out)."""
        hf_logging.disable_progress_bar()  # as the policy's backend: no bar per load
        return cls(AutoModel.from_pretrained(model_dir, dtype=torch.float32), **kwargs)

    def values(
        self, seqs: Sequence[Sequence[int]], starts: Sequence[int] | None = None
    ) -> torch.Tensor:
        """The value stream of `seqs` packed into one forward (with gradients), float32;
        entries before starts[i] are 0 and their head rows never computed."""
        input_ids, position_ids, cu_seqlens = pack_sequences(seqs)
        in_stream, scored = scored_rows(seqs, starts)
        rows = scored.nonzero()[:, 0].to(self.device)
        bounds = {} if self._packed_by_position else {"cu_seq_lens_q": cu_seqlens}
        on = self.compute_dtype != torch.float32
        with torch.autocast(self.device.type, dtype=self.compute_dtype, enabled=on):
            hidden = self.model.trunk(
                input_ids=input_ids[None].to(self.device),
                position_ids=position_ids[None].to(self.device),
                **bounds,
            ).last_hidden_state[0]  # [T, H]
        # The head in float32: values of a few units must not round to bf16's 3 digits.
        v = self.model.head(hidden[rows].float())[:, 0]  # [scored]
        every = torch.zeros(len(input_ids), dtype=v.dtype, device=self.device)
        kept = in_stream.nonzero()[:, 0].to(self.device)
        return every.index_put((rows,), v)[kept]

    def stream(
        self, seqs: Sequence[Sequence[int]], starts: Sequence[int] | None = None
    ) -> torch.Tensor:
        """MicroBatchLoops' packed forward: the value stream (self.values; no entropy)."""
        return self.values(seqs, starts)

    def reduce_grads(self, dp: DataParallel) -> None:
        dp.all_reduce_grads(self.params)

    def _set_lr(self) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = self.optimizer_spec.lr_at(self.n_steps)

    def optimizer_step(self) -> float:
        """Clip, step, and reset gradients; returns the gradient norm before clipping."""
        norm = torch.nn.utils.clip_grad_norm_(self.params, self.optimizer_spec.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.n_steps += 1
        self._set_lr()
        return float(norm)

    # ---- checkpoint ---------------------------------------------------------------------

    def save(self, directory: Path) -> None:
        """Weights (trunk and head), Adam's state and the steps taken, into a checkpoint
        directory being written (global rank 0)."""
        state = {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "n_steps": self.n_steps,
        }
        save_rank_state(Path(directory), CHECKPOINT_NAME, state)

    def load(self, directory: Path) -> None:
        """Every rank: what save wrote; a ValueError if the checkpoint has no critic."""
        if not (Path(directory) / f"{CHECKPOINT_NAME}.json").exists():
            raise ValueError(
                f"{directory} holds no critic (critic.json): it was written by a run without "
                "ppo.adv_estimator=gae. Resume with that run's objective, or start a new run "
                "with model.path=<the checkpoint's model/ directory>"
            )
        state = load_rank_state(Path(directory), CHECKPOINT_NAME)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.n_steps = int(state["n_steps"])
        self._set_lr()
