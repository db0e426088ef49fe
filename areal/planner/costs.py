"""Cost models of the roles, and the profile that holds them (a small JSON file).

    decode step  = (step_s + row_s * rows + cell_s * cells
                    + prefill_token_s * prefilled tokens + prefill_row_s * prefilled rows)
                   / speedup(threads)           + group_s per group arriving (HTTP, outside)
    proximal     = (prox_token_s * tokens + prox_seq_s * seqs + prox_const_s) / speedup
    one update   = (token_s * tokens + seq_s * seqs + sq_s * sum(len^2) + mb_s * micro-batches
                    + minibatch_s) / speedup          (a PPO minibatch: forward, backward, step)
    a step also  = step_s outside those spans (batch decoding, metrics), rpc_s floor of get_batch
    hand-off     = publish_s (trainer) + fanout_s (controller) ; load_s (each server)
    controller   = controller[data plane] CPU seconds per trajectory on its one core: a plan
                   that needs more trajectories a second than 1 / that runs at that limit
    lengths      = the output lengths of whole groups (dealt shuffled), or a lognormal

`cells` is the KV cache the step reads: on a GPU (paged attention) its rows' contexts (prompt +
output so far); on a CPU the embedded engine reads chunks of neighbouring rows up to each
chunk's longest row (areal/rollout/chunks.py), so one long answer among short ones costs
rows x its length. A long context costs memory traffic on a CPU and bounds a step on a GPU.
speedup(threads) is the speed on that many torch threads against one; on a GPU it is 1.

A profile is calibrated from a run (calibrate.py) or built from published figures (gpu_h200).
Torch-free on purpose: the planner must import in a blink.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from areal.config import ConfigError
from areal.trainer.micro_batches import allocate_micro_batches

PROFILE_VERSION = 1


@dataclass
class DecodeCost:
    step_s: float
    """Per decode step whatever its rows: the forward's launch, sampling, Python."""
    row_s: float
    """Per row of a step (the weights' arithmetic per token, sampling)."""
    cell_s: float
    """Per cell of KV cache a step reads: on a CPU the embedded engine's attention chunks
    (areal/rollout/chunks.py: a chunk of rows reads up to its longest row), on a GPU the
    contexts' tokens."""
    prefill_token_s: float
    """Per token prefilled (a new request's prompt; every prefix again after a weight load)."""
    prefill_row_s: float = 0.0
    """Per request prefilled (its bucket, its row's reset)."""
    group_s: float = 0.0
    """Server time per group outside decode steps (its requests and responses over HTTP,
    taking the cores back from a borrower): the decode steps wait meanwhile."""
    speedup: dict[int, float] = field(default_factory=lambda: {1: 1.0})
    """Speed on n threads against one; a thread count not listed uses the nearest below."""

    def step_time(
        self, rows: int, cells: float, prefill: float = 0.0, prefill_rows: int = 0
    ) -> float:
        """Seconds of one step on one thread."""
        return (
            self.step_s
            + self.row_s * rows
            + self.cell_s * cells
            + self.prefill_token_s * prefill
            + self.prefill_row_s * prefill_rows
        )


@dataclass
class TrainCost:
    token_s: float
    """Per token of a PPO minibatch update (forward + backward), on one trainer device."""
    seq_s: float = 0.0
    """Per sequence of an update."""
    sq_s: float = 0.0
    """Per squared sequence length (attention's share; 0 where it is negligible)."""
    mb_s: float = 0.0
    """Per micro-batch of an update."""
    minibatch_s: float = 0.0
    """Per minibatch: the optimizer step, gradient clipping."""
    prox_token_s: float = 0.0
    """Per token of the proximal pass (a no-grad forward)."""
    prox_seq_s: float = 0.0
    prox_const_s: float = 0.0
    step_s: float = 0.0
    """Per step outside the spans: decoding the batch, advantages, metrics, save checks."""
    rpc_s: float = 0.0
    """get_batch when the batch is ready: the RPC and the trajectories' transfer."""
    speedup: dict[int, float] = field(default_factory=lambda: {1: 1.0})

    def update_time(self, tokens: float, seqs: int, sq: float, mbs: int) -> float:
        return (
            self.token_s * tokens
            + self.seq_s * seqs
            + self.sq_s * sq
            + self.mb_s * mbs
            + self.minibatch_s
        )

    def proximal_time(self, tokens: float, seqs: int) -> float:
        if not seqs:
            return 0.0
        return self.prox_token_s * tokens + self.prox_seq_s * seqs + self.prox_const_s


@dataclass
class Handoff:
    publish_s: float
    """The trainer writes weights/vN and tells the controller."""
    load_s: float
    """A server loads vN (an interrupting load: abort, wait for the step, copy)."""
    fanout_s: float = 0.0
    """The controller's fan-out beyond the slowest load (RPCs, retiring old versions)."""


@dataclass
class Lengths:
    """Output lengths of a group's samples, and the prompt length."""

    prompt_len: float
    groups: list[list[int]] | None = None
    """Whole groups as a run produced them (resampled whole: a prompt sets its answers'
    lengths, so a group's samples are alike)."""
    lognormal: tuple[float, ...] | None = None
    """(median, sigma[, between]) of lognormal lengths, where no run gives them (a GPU
    profile): `between` is the share of the log-variance that a group's prompt sets (0:
    its samples are independent; 1: all alike)."""

    def draws(self, rng: random.Random, group_size: int, cap: int) -> Iterator[list[int]]:
        """Groups' output lengths, one group per next(). Whole groups are dealt like a
        shuffled deck, each once before any again: drawn with replacement from a long tail
        (tiny_longtail's), a 40-step simulation's mean length ranged from 14% under its
        pool's to 10% over across ten seeds."""
        if self.groups:
            while True:
                for group in rng.sample(self.groups, len(self.groups)):
                    if len(group) != group_size:  # another config's group size
                        group = [rng.choice(group) for _ in range(group_size)]
                    yield [max(1, min(cap, int(n))) for n in group]
        assert self.lognormal is not None
        median, sigma, between = (*self.lognormal, 0.0)[:3]
        spread, within = sigma * math.sqrt(between), sigma * math.sqrt(1 - between)
        while True:
            center = math.log(median) + rng.gauss(0.0, spread)
            yield [
                max(1, min(cap, int(math.exp(center + rng.gauss(0.0, within)))))
                for _ in range(group_size)
            ]

    def mean(self, cap: int) -> float:
        if self.groups:
            flat = [min(cap, n) for g in self.groups for n in g]
            return sum(flat) / len(flat)
        draws = self.draws(random.Random(0), 1, cap)
        return sum(next(draws)[0] for _ in range(4000)) / 4000


@dataclass
class Profile:
    device: str
    """"cpu": roles share `cores` (and lend them); "gpu": each role computes on its own GPUs."""
    decode: DecodeCost
    train: TrainCost
    handoff: Handoff
    lengths: Lengths
    cores: int = 0
    """CPU: the node's cores that servers and trainer ranks share."""
    group_overhead_s: float = 0.0
    """Controller, rollout worker and grading per group, off the servers' and trainer's time:
    from admission to the server, and from the last sample to the buffer."""
    kv_budget: int = 0
    """GPU: tokens of KV cache per server (0: unbounded, as on a CPU's memory)."""
    controller: dict[str, float] = field(default_factory=dict)
    """CPU seconds the controller, one Python process, spends per trajectory trained (admission,
    the staleness gate, the buffer, get_batch), by rollout.data_plane; a plane not listed is
    not measured, and the plan leaves the controller out."""
    source: str = ""
    notes: list[str] = field(default_factory=list)
    """What is assumed rather than measured."""

    def to_dict(self) -> dict:
        d = asdict(self)
        d["version"] = PROFILE_VERSION
        for part in ("decode", "train"):  # JSON keys are strings
            d[part]["speedup"] = {str(k): v for k, v in d[part]["speedup"].items()}
        return d

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")


def speed(speedup: dict[int, float], threads: int) -> float:
    """The speed-up of `threads` threads: the listed count at or below it."""
    below = [n for n in speedup if n <= threads]
    return speedup[max(below)] if below else 1.0


def _section(d: dict, name: str, cls: type, where: str):
    if not isinstance(d.get(name), dict):
        raise ConfigError(
            f"{where}: the profile has no '{name}' section. Make one with "
            "`python -m areal.planner --calibrate RUN_DIR --save-profile FILE` or use the "
            "built-in GPU profile (--profile h200)"
        )
    part = dict(d[name])
    if "speedup" in part:
        try:
            part["speedup"] = {int(k): float(v) for k, v in part["speedup"].items()}
        except (TypeError, ValueError, AttributeError):
            raise ConfigError(
                f"{where}: {name}.speedup must map thread counts to speed-ups, e.g. "
                '{"1": 1.0, "2": 1.6}'
            ) from None
    try:
        obj = cls(**part)
    except TypeError as e:
        raise ConfigError(f"{where}: section '{name}' is not a {cls.__name__}: {e}") from None
    for key, value in asdict(obj).items():
        if isinstance(value, float | int) and not isinstance(value, bool):
            if not math.isfinite(value) or value < 0:
                raise ConfigError(
                    f"{where}: {name}.{key} = {value!r}: a cost must be a finite number >= 0; "
                    "calibrate again from a run that trained at least a few steps"
                )
    return obj


def _controller(d: object, where: str) -> dict[str, float]:
    if not isinstance(d, dict) or not all(
        isinstance(v, int | float) and math.isfinite(v) and v >= 0 for v in d.values()
    ):
        raise ConfigError(
            f"{where}: controller must map a data plane to CPU seconds per trajectory, e.g. "
            '{"pull": 0.00025}'
        )
    return {str(k): float(v) for k, v in d.items()}


def profile_from_dict(d: dict, where: str = "profile") -> Profile:
    """A Profile from its JSON form; ConfigError naming what is wrong and what to do."""
    if not isinstance(d, dict):
        raise ConfigError(f"{where} is not a JSON object: not a planner profile")
    if d.get("version", PROFILE_VERSION) != PROFILE_VERSION:
        raise ConfigError(
            f"{where} is a version {d.get('version')} profile; this planner reads version "
            f"{PROFILE_VERSION}: calibrate it again"
        )
    if d.get("device") not in ("cpu", "gpu"):
        raise ConfigError(f"{where}: device must be 'cpu' or 'gpu', got {d.get('device')!r}")
    lengths = dict(d.get("lengths") or {})
    if not lengths.get("groups") and not lengths.get("lognormal"):
        raise ConfigError(
            f"{where}: the profile has no output lengths (lengths.groups or "
            "lengths.lognormal): calibrate from a run that wrote batches.jsonl"
        )
    if lengths.get("lognormal"):
        lengths["lognormal"] = tuple(lengths["lognormal"])
    profile = Profile(
        device=d["device"],
        decode=_section(d, "decode", DecodeCost, where),
        train=_section(d, "train", TrainCost, where),
        handoff=_section(d, "handoff", Handoff, where),
        lengths=Lengths(**lengths),
        cores=int(d.get("cores", 0)),
        group_overhead_s=float(d.get("group_overhead_s", 0.0)),
        kv_budget=int(d.get("kv_budget", 0)),
        controller=_controller(d.get("controller", {}), where),
        source=str(d.get("source", "")),
        notes=list(d.get("notes", [])),
    )
    if profile.device == "cpu" and profile.cores < 1:
        raise ConfigError(f"{where}: a cpu profile needs cores >= 1 (the node's cores)")
    return profile


def load_profile(path: str | Path) -> Profile:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(
            f"no profile at {path}: give a profile JSON written by --save-profile, a run "
            "directory to calibrate from, or 'h200' for the built-in GPU profile"
        )
    try:
        d = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not valid JSON ({e}): not a planner profile") from None
    return profile_from_dict(d, str(path))


# ---- the GPU profile: the H200 figures of docs/benchmarks/gpu.md ----------------------------

# DeepSeek-R1-Distill-Qwen-1.5B (Qwen2): 28 layers, 2 KV heads of 128, bf16.
_KV_BYTES_PER_TOKEN = 28 * 2 * 2 * 128 * 2
_H200_BANDWIDTH = 4.8e12  # bytes/s, the card's HBM3e (datasheet)
_H200_MEMORY = 141e9
_WEIGHTS_BYTES = 3.5e9  # docs/benchmarks/gpu.md, handoff.py: weights/vN of the 1.5B shape
# docs/benchmarks/gpu.md: the embedded engine decodes 3,546 tok/s at batch 64 and
# 13,843 at batch 256 (256 new tokens, short prompts: the cache term is small there).
_DECODE_64, _DECODE_256 = 64 / 3546, 256 / 13843  # seconds a step
# megatron_mfu.py: 42,670 tok/s an update (forward + backward + Adam) at 8 x 2,048 tokens.
_TRAIN_TOK_S = 42670.0
_ADAM_S = 0.034  # the profile of an update: Adam's multi-tensor kernels, about 34 ms
_PUBLISH_S, _LOAD_S = 4.489, 0.381  # handoff.py --shapes 1.5b --backend megatron
# benchmarks/data_plane.py (fake servers, ~8k-token trajectories, the real controller on one
# of two loaded cores): the controller's CPU per trajectory with each data plane.
_CONTROLLER_S = {"pull": 0.234e-3, "relay": 5.68e-3}
_ATTN_FLOPS_PER_SQ = 6 * 28 * 1536  # causal attention (2 L^2 d a layer) x 3 for fwd + bwd
_ACHIEVED_FLOPS = 418e12  # megatron_mfu.py's 418 TFLOP/s


def gpu_h200(
    prompt_len: float = 300.0, median_len: float = 5000.0, sigma: float = 0.9, between: float = 0.5
) -> Profile:
    """The 1.5B model on H200s, from docs/benchmarks/gpu.md's rows; `notes` say what is assumed."""
    row_s = (_DECODE_256 - _DECODE_64) / (256 - 64)
    return Profile(
        device="gpu",
        decode=DecodeCost(
            step_s=_DECODE_64 - 64 * row_s,
            row_s=row_s,
            cell_s=_KV_BYTES_PER_TOKEN / (0.7 * _H200_BANDWIDTH),
            prefill_token_s=1.0 / (3 * _TRAIN_TOK_S),
        ),
        train=TrainCost(
            token_s=1.0 / _TRAIN_TOK_S,
            sq_s=_ATTN_FLOPS_PER_SQ / _ACHIEVED_FLOPS,
            minibatch_s=_ADAM_S,
            prox_token_s=1.0 / (3 * _TRAIN_TOK_S),
            step_s=2.0,
            rpc_s=1.0,
        ),
        handoff=Handoff(publish_s=_PUBLISH_S, load_s=_LOAD_S, fanout_s=0.05),
        lengths=Lengths(prompt_len=prompt_len, lognormal=(median_len, sigma, between)),
        group_overhead_s=0.05,
        kv_budget=int((0.85 * _H200_MEMORY - _WEIGHTS_BYTES) / _KV_BYTES_PER_TOKEN),
        controller=dict(_CONTROLLER_S),
        source="'Measured on GPU', docs/benchmarks/gpu.md (one H200, the 1.5B shape, bf16)",
        notes=[
            "decode step_s/row_s: the embedded engine's 18 ms steps at batch 64 and 256 "
            "(SGLang, which the paper serves with, steps faster: not measured here)",
            "decode cell_s: the 1.5B model's KV cache (28 KB a token) read at 70% of the "
            "H200's 4.8 TB/s (assumed; docs/benchmarks/gpu.md has no long-context GPU step)",
            "prefill: a third of a training token's cost (a forward of the 42,670 tok/s update)",
            "train: megatron 42,670 tok/s per GPU at 2k-token sequences, data parallel "
            "scaling linear in the training GPUs (assumed); attention's L^2 term from FLOPs at "
            "the measured 418 TFLOP/s; Adam 34 ms a minibatch",
            "per step 2 s outside the spans and 1 s for get_batch's transfer (assumed)",
            "hand-off: publish 4,489 ms, load 381 ms (handoff.py); fan-out 50 ms (assumed)",
            f"lengths: lognormal, median {median_len:,.0f} tokens, sigma {sigma}, capped at "
            f"max_new_tokens (mean about 7k at the defaults), half the log-variance set by the "
            f"prompt (between={between}; assumed: no dataset here), prompts {prompt_len:.0f} "
            "tokens",
            "KV budget: 85% of 141 GB less the weights; the H200's figures stand in for the "
            "paper's H800s",
            "controller: 0.234 ms of CPU per trajectory pulled, 5.68 ms relayed "
            "(benchmarks/data_plane.py on this project's 2-core CPU machine)",
        ],
    )


BUILTIN = {"h200": gpu_h200}
"""Profiles by name (--profile h200)."""


def micro_batch_count(seqlens: list[int], max_tokens: int) -> int:
    """How many micro-batches the trainer packs these sequences into (Algorithm 1, the
    trainer's own allocation); a sequence over the budget is the run's error, said here."""
    try:
        return len(allocate_micro_batches(seqlens, max_tokens))
    except ValueError as e:
        raise ConfigError(str(e)) from None
