"""The embedded engine's data: a request's sampling parameters, its state while it runs, and
its result (imports no torch and no other areal module: the engine, the sampler and the
SGLang contract in sglang_api.py all build on it).
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

PAUSE_MODES = ("abort", "retract", "in_place")
"""/pause_generation's modes (SGLang's)."""


@dataclass(kw_only=True)
class SamplingParams:
    """The subset of SGLang's sampling parameters that the embedded engine implements."""

    max_new_tokens: int = 128
    """Generate at most this many tokens (clipped to the model's context length)."""
    temperature: float = 1.0
    """0 means greedy; the returned log-probs then use temperature 1."""
    top_p: float = 1.0
    """Nucleus sampling mass, in (0, 1]."""
    top_k: int = -1
    """Sample among the k most likely tokens; -1 or 0 turns it off."""
    min_new_tokens: int = 0
    """EOS and stop tokens are masked out until this many tokens exist."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Extra token ids that end generation (ignored with ignore_eos, as in SGLang)."""
    stop: list[str] = field(default_factory=list)
    """Strings that end generation once the decoded output contains them."""
    ignore_eos: bool = False
    """Generate until max_new_tokens whatever tokens appear."""

    def __post_init__(self) -> None:
        if self.max_new_tokens < 0:
            raise ValueError(
                f"sampling_params.max_new_tokens must be >= 0, got {self.max_new_tokens}"
            )
        if self.temperature < 0:
            raise ValueError(f"sampling_params.temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"sampling_params.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"sampling_params.top_k must be -1 (off) or >= 1, got {self.top_k}")
        if not 0 <= self.min_new_tokens <= max(self.max_new_tokens, 0):
            raise ValueError(
                "sampling_params.min_new_tokens must be between 0 and max_new_tokens, "
                f"got {self.min_new_tokens}"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-6


@dataclass
class GenerationResult:
    """One finished request, in SGLang's vocabulary."""

    rid: str
    prompt_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]
    """log_softmax(logits / temperature) of each sampled token, before top-p/top-k."""
    finish_reason: dict[str, Any]
    """{"type": "stop", "matched": id|str} | {"type": "length", "length": n} |
    {"type": "abort", "message": str}"""
    weight_version: int
    """The engine's weight version when the request finished (a string only on the wire)."""
    e2e_latency: float


@dataclass(eq=False)
class Request:
    """A request as the engine holds it, from submit() to its result."""

    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    max_new: int
    stop_ids: frozenset[int]
    future: Future
    created: float = field(default_factory=time.monotonic)
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    done: bool = False
    result: GenerationResult | None = None
    # Owned by the decode thread: the cache row, and whether it holds every token but the
    # last under the current weights.
    row: int = -1
    cached: bool = False

    @property
    def max_len(self) -> int:
        """Cache cells this request may need: prompt + max_new tokens."""
        return len(self.prompt_ids) + self.max_new
