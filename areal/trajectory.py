"""The trajectory: one response to one prompt, with what the trainer needs to learn from it.

Every output token carries the behaviour log-prob the inference engine gave it and the
policy version that produced it; an interrupted generation is resumed and concatenated, so
one trajectory can span several versions (paper, Proposition 1).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np


@dataclass
class Trajectory:
    group_id: int
    """Samples of the same prompt share a group id (unique within a run, resumes included)."""
    prompt_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    """Behaviour log-prob of each output token."""
    versions: list[int] = field(default_factory=list)
    """Policy version that produced each output token."""
    finish_reason: str = ""
    """stop | length (an abort is resumed, never final)."""
    reward: float = 0.0
    start_version: int = 0
    """The version the staleness gate admitted this sample's group under."""
    n_interrupts: int = 0
    """How many times a weight update interrupted and resumed this generation."""
    t_start: float = 0.0
    t_end: float = 0.0
    draw_id: int = -1
    """Which draw from the dataset its prompt is (0, 1, ... over epochs): the same prompt
    generated again (its group failed, or was in flight at a checkpoint) keeps it."""

    def extend(self, ids: list[int], logprobs: list[float], version: int) -> None:
        """Append a generated segment produced by one policy version."""
        assert len(ids) == len(logprobs)
        self.output_ids += ids
        self.logprobs += logprobs
        self.versions += [version] * len(ids)

    def to_wire(self) -> dict:
        d = asdict(self)
        d["prompt_ids"] = np.asarray(self.prompt_ids, dtype=np.int32)
        d["output_ids"] = np.asarray(self.output_ids, dtype=np.int32)
        d["logprobs"] = np.asarray(self.logprobs, dtype=np.float32)
        d["versions"] = np.asarray(self.versions, dtype=np.int32)
        return d

    @classmethod
    def from_wire(cls, d: dict) -> Trajectory:
        d = dict(d)
        for k in ("prompt_ids", "output_ids", "logprobs", "versions"):
            d[k] = np.asarray(d[k]).tolist()
        return cls(**d)
