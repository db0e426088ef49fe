"""The trainer backend seam: what trainer/step.py and trainer/worker.py ask of a backend.

    areal/worker.py --make_backend(cfg) (backends/<trainer.backend>.py builds it)-->
              TorchBackend (torch_backend.py; DP only) or MegatronBackend (megatron/; TP, PP, DP)
    step.py   --forward / forward_backward / reduce_grads / optimizer_step--> the backend
    worker.py --save_hf (publish) / save_optimizer + state_dict (checkpoint)--> the backend

| method              | every rank? | returns / writes                                      |
|---------------------|-------------|-------------------------------------------------------|
| forward             | yes         | each micro-batch's log-prob stream (no gradients)     |
| forward_backward    | yes         | each micro-batch's loss_fn statistics; grads summed   |
| reduce_grads        | yes         | gradients summed over the data-parallel replicas      |
| optimizer_step      | yes         | clip + step + zero; the gradient norm before clipping |
| save_hf             | if collect. | weights/vN/ or a checkpoint's model/ (HF format)      |
| hf_tensors          | if collect. | the same weights in memory, for a broadcast           |
| save_optimizer      | if collect. | the optimizer file(s) of the checkpoint directory     |
| state_dict          | global 0    | plain values for trainer.json (optimizer step count)  |

"if collect.": with `collective_save` every rank of the trainer world calls it at the same
point (global rank 0 passes the directory, the others None: each contributes its slice);
without it global rank 0 alone calls it, with a directory. This module declares the seam and
imports none of its implementations (the registry, backends/, finds one by trainer.backend).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch

from areal.config import DTYPES as DTYPE_NAMES
from areal.trainer.batching import LossFn
from areal.trainer.parallel import DataParallel

DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}
"""Config dtype names (model.dtype, trainer.save_dtype) -> torch dtypes."""


def optimizer_file(tp_rank: int = 0, stage: int = 0) -> str:
    """The checkpoint's name (.safetensors/.json) of the optimizer state of one model-parallel
    position; a data-parallel-only backend is the single position (0, 0)."""
    return f"optimizer-tp{tp_rank}-pp{stage}"


@runtime_checkable
class TrainerBackend(Protocol):
    """A model and its optimizer, trained on packed micro-batches of token sequences.

    A log-prob stream holds L-1 entries per sequence of length L: entry t is
    log p(token t+1 | tokens <= t) under logits / temperature. `starts[i]` (per sequence)
    is the first entry the caller reads: entries before it are 0, and a backend skips
    computing what it can of them.
    """

    model: torch.nn.Module
    """The module trained (the trainer hooks its layers to adapt its threads: areal/cores.py)."""
    collective_save: bool
    """True: every rank of the trainer world takes part in save_hf and save_optimizer."""

    def logprobs(
        self,
        seqs: Sequence[Sequence[int]],
        starts: Sequence[int] | None = None,
        with_entropy: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The log-prob stream of `seqs` packed into one forward (with gradients); with
        with_entropy, also the per-token entropy stream (a backend may refuse: ValueError)."""
        ...

    def logits(self, seqs: Sequence[Sequence[int]]) -> torch.Tensor:
        """Full-vocabulary logits [T, V] of the packed stream, without temperature (checks
        against an HF model)."""
        ...

    def forward(
        self,
        micro_batches: Sequence[Sequence[Sequence[int]]],
        starts: Sequence[Sequence[int]] | None = None,
    ) -> list[torch.Tensor]:
        """Each micro-batch's log-prob stream (float32, CPU, no gradients), on every rank."""
        ...

    def forward_backward(
        self,
        micro_batches: Sequence[Sequence[Sequence[int]]],
        loss_fn: LossFn,
        starts: Sequence[Sequence[int]] | None = None,
        with_entropy: bool = False,
    ) -> list[dict[str, float]]:
        """loss_fn(k, log-prob stream of micro-batch k) -> (loss, stats); loss.backward(),
        gradients accumulating. Each micro-batch's stats, on every rank. with_entropy:
        loss_fn(k, log-probs, per-token entropy) (a backend may refuse it: ValueError).
        batching.MicroBatchLoops is the plain loop (loss_fn called from its own frame)."""
        ...

    def reduce_grads(self, dp: DataParallel) -> None:
        """Sum the gradients over the data-parallel replicas (a no-op without them)."""
        ...

    def optimizer_step(self) -> float:
        """Clip, step, and reset gradients; returns the gradient norm before clipping."""
        ...

    def save_hf(self, out_dir: Path | None) -> None:
        """Write an HF model directory at out_dir (None: a collective save's other ranks)."""
        ...

    def hf_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """(HF name, tensor) of every weight save_hf writes, for a broadcast
        (weights.transport=distributed); if collect., every rank calls it (empty but on
        global rank 0)."""
        ...

    def save_optimizer(self, directory: Path | None) -> None:
        """Write the optimizer state into a checkpoint directory being written (None: a
        collective save's other ranks); returns once every rank's file is written."""
        ...

    def load_optimizer(self, directory: Path) -> None:
        """Every rank: the optimizer state save_optimizer wrote. After load_state_dict."""
        ...

    def state_dict(self) -> dict:
        """Global rank 0's plain part of the trainer state (trainer.json)."""
        ...

    def load_state_dict(self, state: dict) -> None:
        """Every rank: restore state_dict(); a ValueError if the checkpoint cannot resume
        this run (what to do instead in its message)."""
        ...
