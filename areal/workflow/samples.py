"""From an agent's recorded LLM calls to training samples, never re-tokenizing text.

calls c_0 .. c_n (exact input ids, output ids, log-probs, versions, in call order)
rewards r_i (per call) --> returns R_i = r_i + gamma * R_(i+1)   (applied once, here)

individual: one sample per call:  prompt = c_i.input, output = c_i.output, reward R_i
concat:     one sample per episode, if every c_i.input starts with
            c_(i-1).input + c_(i-1).output (the chat template appends, and the text the
            agent sent back re-tokenized to the same ids):
            prompt = c_0.input, output = c_0.output + env_1 + c_1.output + ...,
            loss mask 1 on the model's tokens, 0 on env_i (other turns, tool results),
            reward R_0; otherwise None, and the caller falls back to individual.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace

from areal.trajectory import Trajectory


@dataclass(kw_only=True)
class Call:
    """One chat or completion call: exactly what the engine received and produced."""

    id: str
    """The id the agent saw (ChatCompletion.id): per-call rewards are keyed by it."""
    traj: Trajectory
    """prompt_ids = the input ids, output ids, log-probs and versions of the call."""
    tool_calls: int = 0
    """Tool calls the endpoint returned for it (parsed from the model's text)."""


def call_rewards(result: object, calls: Sequence[Call]) -> list[float]:
    """Each call's own reward r_i from what the agent returned: a number is the episode's
    reward, given to its last call; a dict maps call ids to rewards (others get 0).
    ValueError says what is wrong with anything else."""
    rewards = [0.0] * len(calls)
    if isinstance(result, bool) or not isinstance(result, int | float | Mapping):
        raise ValueError(
            f"the agent returned {result!r:.100}; return a float (the episode's reward) or a "
            "dict {completion.id: reward}"
        )
    if isinstance(result, Mapping):
        index = {c.id: i for i, c in enumerate(calls)}
        for key, value in result.items():
            if key not in index:
                raise ValueError(f"the agent rewarded {key!r}, which is no call of its episode")
            rewards[index[key]] = _finite(value, key)
    elif calls:
        rewards[-1] = _finite(result, "the episode")
    return rewards


def _finite(value: object, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"the reward of {what} is {value!r}; rewards must be finite numbers")
    return float(value)


def discounted_returns(rewards: Sequence[float], gamma: float) -> list[float]:
    """R_i = r_i + gamma * R_(i+1), the last call's R = r."""
    returns, running = [0.0] * len(rewards), 0.0
    for i in reversed(range(len(rewards))):
        running = rewards[i] + gamma * running
        returns[i] = running
    return returns


def individual_samples(calls: Sequence[Call], returns: Sequence[float]) -> list[Trajectory]:
    """One sample per call: the call's trajectory, every field kept, its reward the return."""
    return [
        replace(call.traj, reward=ret, **_own_lists(call.traj))
        for call, ret in zip(calls, returns, strict=True)
    ]


def _own_lists(t: Trajectory) -> dict[str, list]:
    """Copies of t's token lists: a sample never shares them with the recorded call."""
    return {f.name: list(v) for f in fields(t) if isinstance(v := getattr(t, f.name), list)}


def concat_sample(calls: Sequence[Call], returns: Sequence[float]) -> Trajectory | None:
    """The whole episode as one sequence, or None where a call's input does not extend the
    previous call's input + output token for token."""
    if not calls:
        return None
    first = calls[0].traj
    seq = list(first.prompt_ids)
    # The first call's fields (group, draw, start version and time); its output is the loop's.
    out = replace(
        first,
        prompt_ids=list(first.prompt_ids),
        output_ids=[],
        logprobs=[],
        versions=[],
        loss_mask=[],
        n_interrupts=0,
        reward=returns[0],
    )
    for i, call in enumerate(calls):
        t = call.traj
        if i > 0:
            if t.prompt_ids[: len(seq)] != seq:
                return None
            env = t.prompt_ids[len(seq) :]
            # Not the model's: no log-prob, and the version of the token before them, so
            # the sample's oldest token is a model token's.
            out.output_ids += env
            out.logprobs += [0.0] * len(env)
            out.versions += [out.versions[-1]] * len(env)
            out.loss_mask += [0] * len(env)
            seq += env
        out.output_ids += t.output_ids
        out.logprobs += t.logprobs
        out.versions += t.versions
        out.loss_mask += [1] * len(t.output_ids)
        out.n_interrupts += t.n_interrupts
        seq += t.output_ids
    last = calls[-1].traj
    out.finish_reason, out.t_end = last.finish_reason, last.t_end
    return out
