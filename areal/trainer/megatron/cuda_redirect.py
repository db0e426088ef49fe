"""The CUDA calls megatron-core 0.16 makes even on a CPU model, redirected to the CPU.

Measured on a CPU-only machine (shared/DEPENDENCIES.md): the local layer spec runs over
gloo except for four places that ask for a CUDA device unconditionally:

1) rotary embeddings move `inv_freq` to `torch.cuda.current_device()` on first use;
2) `DotProductAttention` takes its score buffer from the global memory buffer, which
   allocates on `torch.cuda.current_device()`;
3) `model_parallel_cuda_manual_seed` and the RNG tracker's `fork()` (entered by every
   attention forward) read and write the CUDA RNG state;
4) with tied embeddings and pp > 1, GPTModel's constructor moves the last stage's copy of
   the embedding to `.cuda()` before the all-reduce that makes it equal the first stage's.

(1) and (2) are redirected by making `torch.cuda.current_device()` answer "cpu": without
CUDA that call can only raise, so no working code path changes meaning. (3) is redirected
by a tracker whose fork is a no-op (Megatron's own inference tracker) plus a CPU seed: our
Qwen2 models have no dropout, so no random numbers are drawn inside a fork. (4) is
redirected only while a model is built (`cpu_tensors_stay()`): `Tensor.cuda()` returns the
tensor itself, so the all-reduce runs on the CPU tensor over gloo.

`apply()` does nothing when CUDA is present: the GPU path is Megatron's own.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

_applied = False


def _cpu_current_device() -> str:
    return "cpu"


def apply() -> bool:
    """Redirect the three calls if (and only if) CUDA is absent; True if redirected."""
    global _applied
    if torch.cuda.is_available():
        return False
    if not _applied:
        torch.cuda.current_device = _cpu_current_device  # (1) and (2)
        _applied = True
    return True


def seed(seed: int) -> None:
    """Megatron's model-parallel seeding on GPU; on CPU, (3): a no-op RNG tracker."""
    from megatron.core import tensor_parallel
    from megatron.core.tensor_parallel import random as mp_random

    if not apply():
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
        return
    # Initialisation on the CPU (use_cpu_initialization) draws from the CPU generator.
    torch.manual_seed(seed)
    mp_random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)


@contextlib.contextmanager
def cpu_tensors_stay() -> Iterator[None]:
    """(4): inside, `Tensor.cuda()` is the identity when CUDA is absent (else untouched)."""
    if torch.cuda.is_available():
        yield
        return
    real = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    try:
        yield
    finally:
        torch.Tensor.cuda = real
