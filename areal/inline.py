"""A whole run in one Python process, built from objects: `areal.build(model, tokenizer,
task, config)` returns a Run whose `step()` trains one version while the engines go on
generating (written out in your loop: `batch = run.next_batch()`, `stats =
run.ppo_update(batch)`, `run.publish(batch, stats)`); `python -m areal.train --config
configs/tiny.yaml launcher.type=inline` is the same build from the config (run_inline).

```
 main thread            your loop: run.next_batch() -> run.ppo_update(batch) (ppo.py's
   |                      loss) -> run.publish(...) weights/vN (= run.step(), Trainer.step)
   |  BlockingRpc: the call runs on the roles' loop; the trainer waits for its answer
 thread "inline-roles"  one asyncio loop: Controller (gate, buffer, episodes),
   |                      RolloutWorker k --EngineClient--> DecodeEngine k, RewardService
 thread "decode" (per engine)  continuous batching, as in the embedded server
```

| waits for                        | unblocked by                                          |
|----------------------------------|-------------------------------------------------------|
| run.next_batch(): its batch      | the controller's buffer holding one allowed at version|
|                                  | i (max_staleness), or the roles' failure (NoProgress) |
| run.close(): the roles' stop     | their tasks cancelled (60 s deadline), engines joined |

The roles are the objects a normal run builds, wired without sockets: an RPC client is an
InProcessRpc (comm/inproc.py) that awaits the object's method, its arguments and result
round-tripped through the wire's msgpack so that they are what a peer would receive. The
rollout worker's inference client is an EngineClient (no HTTP). The trainer trains while
the engines generate (the staleness bound, metrics.jsonl and checkpoints are the normal
run's); weights still go through weights/vN on disk. Only the embedded engine on CPU, one
trainer rank, no restarts. A breakpoint anywhere (e.g. in ppo.py's loss) stops its thread
with the others running on.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import functools
import importlib
import logging
import shutil
import sys
import threading
from collections.abc import Awaitable, Callable, Mapping, Sequence
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from areal.comm.inproc import BlockingRpc, InProcessRpc
from areal.comm.wire import unpack
from areal.config import ConfigError, ExperimentConfig, from_dict, load_config

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase

    from areal.checkpoint import Checkpoint
    from areal.rollout.engine import DecodeEngine
    from areal.tasks import Task
    from areal.trainer.step import StepBatch
    from areal.trainer.worker import Trainer
    from areal.workflow import Workflow

log = logging.getLogger("areal.inline")

START_TIMEOUT_S = 300.0
"""Deadline of the roles' start (reward pool, rollout workers, controller) on their loop."""
STOP_TIMEOUT_S = 60.0
"""Deadline of their stop: cancelled tasks, closed clients, the reward pool joined."""


@dataclass
class _Roles:
    """The asyncio side: the loop's thread and what runs on it."""

    loop: asyncio.AbstractEventLoop
    controller_rpc: InProcessRpc | None = None
    failure: BaseException | None = None
    """Set when the controller stops making progress or a loop fails."""
    stop: Callable[[], Awaitable[None]] | None = None
    tasks: list[asyncio.Task] = field(default_factory=list)


async def _start_roles(
    roles: _Roles,
    cfg: ExperimentConfig,
    engines: list,
    tokenizer: Any,
    rows: list[dict],
    resume_from: Checkpoint | None,
    episodes: _Episodes,
) -> None:
    """Build reward service, rollout workers and controller on this loop, as
    areal/worker.py's roles and run_controller do, and start admitting."""
    from areal.controller.failures import NoProgress
    from areal.reward.service import RewardService
    from areal.rollout.engine_client import EngineClient
    from areal.rollout.worker import RolloutWorker
    from areal.worker import make_controller

    inf = cfg.inference
    reward = RewardService(cfg.reward, episodes.tasks)
    workers = []
    for k, engine in enumerate(engines):
        client = EngineClient(engine, f"inline://engine{k}")
        workers.append(
            RolloutWorker(
                client.base_url,
                client_factory=lambda url, api_key=None, client=client: client,
                interruptible=cfg.rollout.interruptible,
                update_timeout_s=inf.update_timeout_s,
                update_retries=inf.update_retries,
                recovery_timeout_s=inf.startup_timeout_s,
            )
        )
    worker_rpcs = [
        InProcessRpc({n: getattr(w, n) for n in RolloutWorker.RPC_METHODS}, f"rollout{k}")
        for k, w in enumerate(workers)
    ]
    reward_rpc = InProcessRpc({"grade": reward.grade, "stats": reward.stats}, "reward0")
    # One process: every object shares the tokens already, there is nothing to pull.
    controller = make_controller(
        cfg, rows, tokenizer, worker_rpcs, reward_rpc, episodes.workflow, data_plane="relay"
    )
    if resume_from is not None:
        controller.load_state_dict(
            unpack(resume_from.controller_state.read_bytes()), resume_from.version
        )
    roles.controller_rpc = InProcessRpc(
        {
            "get_batch": controller.get_batch,
            "weights_ready": controller.weights_ready,
            "save_state": controller.save_state,
        },
        "controller0",
    )
    admit = asyncio.create_task(controller.admit_loop())
    stalled = asyncio.create_task(controller.stalled.wait())

    def failed(task: asyncio.Task) -> None:
        if task.cancelled() or roles.failure is not None:
            return
        if task is stalled:
            roles.failure = NoProgress(controller.no_progress)
        else:
            roles.failure = task.exception() or RuntimeError("the admit loop ended unexpectedly")

    for task in (admit, stalled):
        task.add_done_callback(failed)

    async def stop() -> None:
        admit.cancel()
        stalled.cancel()
        await asyncio.gather(admit, stalled, return_exceptions=True)
        controller.pool.close()
        for rpc in [*worker_rpcs, reward_rpc, roles.controller_rpc]:
            rpc.close()
        for w in workers:
            await w.client.close()
        await controller.workflow.aclose()
        reward.close()

    roles.stop = stop


# ---------------------------------------------------------------- objects in: areal.build


def build(
    model: torch.nn.Module | str | Path,
    tokenizer: PreTrainedTokenizerBase | None = None,
    task: Task | Workflow | Callable | str = "arith",
    config: ExperimentConfig | Mapping[str, Any] | Sequence[str] | None = None,
    *,
    resume_from: Checkpoint | None = None,
) -> Run:
    """A run in this process, from objects; `with build(...) as run: run.step()`.

    model: a transformers causal LM (trained in place: `run.model`; each engine decodes
    with a copy), or its directory. tokenizer: the model's (a directory's own when None);
    it needs a chat template. task: an areal.tasks.Task (its `is_correct` is the reward:
    a researcher's own), a task's name (dataset.type), or a workflow (a Workflow subclass
    or instance, or an agent function) that runs on the config's dataset. config: an
    ExperimentConfig, a nested mapping, or dotted overrides ("trainer.lr=3e-3"); the run
    writes metrics, weights and checkpoints to its experiment directory, as any run.
    resume_from: the checkpoint run_inline resumes (prepared by train.prepare_experiment).
    """
    cfg = _as_config(config)
    check_inline(cfg)
    model_dir, tokenizer = _model_and_tokenizer(model, tokenizer)
    if model_dir is not None:
        cfg.model.path = model_dir
    else:
        _check_model_object(cfg)
    episodes = _episodes(task, cfg)
    _ready_dir(cfg, resume_from)
    rows = _rows(episodes, cfg, tokenizer)
    run = Run(cfg)
    try:
        _add_engines(run, model, tokenizer, resume_from)
        start = _start_roles(run.roles, cfg, run.engines, tokenizer, rows, resume_from, episodes)
        try:
            run.on_loop(start).result(timeout=START_TIMEOUT_S)
        except FutureTimeout:
            raise RuntimeError(f"the roles did not start within {START_TIMEOUT_S:g} s") from None
        run.trainer = _make_trainer(run, None if model_dir else model, tokenizer)
    except BaseException:
        run.close()
        raise
    return run


class Run:
    """A built run: `step()` trains one version (rollout goes on generating in the
    background within max_staleness), as its three phases `next_batch()`,
    `ppo_update(batch)`, `publish(batch, stats)`; `close()`, or leaving `with`, stops every
    role."""

    def __init__(self, cfg: ExperimentConfig) -> None:
        self.cfg = cfg
        self.engines: list[DecodeEngine] = []
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="inline-roles")
        self.thread.daemon = True  # a failed close must not keep the interpreter alive
        self.thread.start()
        self.roles = _Roles(self.loop)
        self.trainer: Trainer | None = None

    def on_loop(self, coro: Awaitable) -> Any:
        """Run `coro` on the roles' loop; a concurrent Future of its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    @property
    def version(self) -> int:
        """The trainer's version: steps done (a resumed run's included)."""
        return 0 if self.trainer is None else self.trainer.version

    @property
    def model(self) -> torch.nn.Module:
        """The model being trained."""
        if self.trainer is None:
            raise RuntimeError("the run is closed")
        return self.trainer.backend.model

    def step(self) -> dict[str, float]:
        """One asynchronous RL step: next_batch, ppo_update, publish. Returns the step's
        metrics line (reward/mean, loss/..., staleness/max, ...)."""
        return self._trainer().step()

    def next_batch(self) -> StepBatch:
        """The oldest batch the staleness bound allows at this version, prepared for
        ppo_update (trainer/step.py's prepare: proximal log-probs, advantages, masks).
        Raises the roles' failure (controller.failures.NoProgress when episodes only
        fail)."""
        return self._trainer().next_batch()

    @property
    def ppo_update(self) -> Callable[[StepBatch], dict[str, float]]:
        """`run.ppo_update(batch)`: the minibatch updates of the policy (and critic) on
        the batch; returns its statistics. It is trainer/step.py's ppo_update itself, its
        backend and critic bound: ppo.policy_loss runs 3 calls below your loop
        (ppo_update -> backend.forward_backward -> ppo_batch.PolicyLoss -> policy_loss)."""
        from areal.trainer.step import ppo_update

        trainer = self._trainer()
        return functools.partial(ppo_update, trainer.backend, critic=trainer.critic)

    def publish(self, batch: StepBatch, stats: dict[str, float]) -> dict[str, float]:
        """After ppo_update(batch): the new version's weights to the engines, the step's
        metrics line (returned) and a checkpoint when one is due."""
        return self._trainer().publish(batch, stats)

    def _trainer(self) -> Trainer:
        if self.trainer is None:
            raise RuntimeError("the run is closed: build another")
        return self.trainer

    def close(self) -> None:
        """Stop the trainer's files, the roles (within STOP_TIMEOUT_S) and the engines."""
        trainer, self.trainer = self.trainer, None
        try:
            if trainer is not None:
                trainer.close()
            if self.roles.stop is not None and self.loop.is_running():
                stop, self.roles.stop = self.roles.stop, None
                self.on_loop(stop()).result(timeout=STOP_TIMEOUT_S)
                # What the stop left (a weight update the last version started): cancelled
                # and awaited, not destroyed pending with the loop.
                self.on_loop(_cancel_rest()).result(timeout=STOP_TIMEOUT_S)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=10)
            if not self.thread.is_alive():
                self.loop.close()
            for engine in self.engines:
                engine.shutdown()
            self.engines = []

    def __enter__(self) -> Run:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


async def _cancel_rest() -> None:
    """Cancel every other task of this loop and wait for them (a bounded wait)."""
    rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in rest:
        task.cancel()
    if rest:
        await asyncio.wait(rest, timeout=10)


def check_inline(cfg: ExperimentConfig) -> None:
    """What one process can run: the embedded engine and one torch rank (ConfigError)."""
    from areal.rollout.backends import load_backend
    from areal.trainer.backends import load_backend as load_trainer_backend

    if not load_backend(cfg.inference.backend).in_process:
        raise ConfigError(
            f"launcher.type=inline runs the embedded engine in this process, not "
            f"inference.backend={cfg.inference.backend}: set inference.backend=embedded"
        )
    if (
        cfg.trainer.parallel.world_size != 1
        or not load_trainer_backend(cfg.trainer.backend).in_process
    ):
        raise ConfigError(
            "launcher.type=inline trains on one torch rank: set trainer.backend=torch and "
            "trainer.parallel.dp=tp=pp=1"
        )


def _as_config(config: ExperimentConfig | Mapping | Sequence[str] | None) -> ExperimentConfig:
    if config is None:
        return load_config()
    if isinstance(config, ExperimentConfig):
        return config
    if isinstance(config, Mapping):
        return from_dict(dict(config))
    if isinstance(config, Sequence) and not isinstance(config, str | bytes):
        return load_config(None, list(config))
    raise TypeError(
        f"config must be an ExperimentConfig, a nested mapping or a list of dotted overrides "
        f'("trainer.lr=3e-3"); got {type(config).__name__}'
    )


def _model_and_tokenizer(
    model: Any, tokenizer: PreTrainedTokenizerBase | None
) -> tuple[str | None, PreTrainedTokenizerBase]:
    """(the model's directory, or None for a model object; the tokenizer)."""
    import torch

    if isinstance(model, str | Path):
        from areal.preflight import check_model_dir
        from areal.tokenizer import load_tokenizer

        check_model_dir(str(model))  # every problem of the directory at once (ConfigError)
        return str(model), tokenizer or load_tokenizer(str(model))
    if not isinstance(model, torch.nn.Module) or not hasattr(model, "config"):
        raise TypeError(
            f"model must be a transformers causal LM (e.g. AutoModelForCausalLM."
            f"from_pretrained(...)) or its directory; got {type(model).__name__}"
        )
    if tokenizer is None:
        raise ValueError(
            "a model object needs its tokenizer: build(model, tokenizer, ...) (or pass the "
            "model's directory, which holds one)"
        )
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "the tokenizer has no chat template: every task renders its prompts with it; "
            "set tokenizer.chat_template"
        )
    return None, tokenizer


def _check_model_object(cfg: ExperimentConfig) -> None:
    """What needs the model's files refuses a model object, saying what to give instead."""
    if cfg.model.lora.enabled:
        raise ValueError("model.lora needs the model's directory: pass its path as the model")
    if cfg.ppo.kl_coef > 0 and not (cfg.ref_model.path or cfg.model.path):
        raise ValueError(
            "ppo.kl_coef > 0 loads the reference policy from a directory: set ref_model.path, "
            "or pass the model's directory"
        )
    if cfg.ppo.adv_estimator == "gae" and not (cfg.critic.path or cfg.model.path):
        raise ValueError(
            "ppo.adv_estimator=gae loads the critic from a directory: set critic.path, or pass "
            "the model's directory"
        )


@dataclass
class _Episodes:
    """What build's `task` becomes: the rows' task and its name, the tasks the reward
    service takes as objects, and the workflow (None: rollout.workflow's)."""

    task: Task
    spec: str
    tasks: dict[str, Task] = field(default_factory=dict)
    workflow: Workflow | None = None


def _importable(fn: Any) -> bool:
    """Whether a pool process finds `fn` by its module and name (how it travels there)."""
    try:
        obj = importlib.import_module(fn.__module__)
        for part in fn.__qualname__.split("."):
            obj = getattr(obj, part)
    except (AttributeError, ImportError, TypeError):
        return False
    return obj is fn


def _episodes(task: Any, cfg: ExperimentConfig) -> _Episodes:
    from areal.tasks import Task, load_task
    from areal.workflow import as_workflow, is_workflow

    if isinstance(task, str):
        if task != cfg.dataset.type:  # its own options, checked as the config checks them
            cfg.dataset = dataclasses.replace(cfg.dataset, type=task, options={})
        return _Episodes(load_task(task), task)
    if isinstance(task, Task):
        if not task.grade_inline:  # graded in the reward pool: it must travel there
            if not _importable(task.is_correct):
                raise ValueError(
                    f"task {task.name!r}: its is_correct is graded in a pool process and must "
                    "be a module-level function (the pool imports it by name); or set "
                    "grade_inline=True (a cheap grader that cannot hang)"
                )
        return _Episodes(task, task.name, {task.name: task})
    if is_workflow(task):
        workflow = as_workflow(task, cfg.rollout)
        return _Episodes(load_task(cfg.dataset.type), cfg.dataset.type, workflow=workflow)
    raise TypeError(
        "task must be an areal.tasks.Task, a task's name (dataset.type), or a workflow (a "
        f"Workflow subclass or instance, or an agent function); got {type(task).__name__}"
    )


def _rows(episodes: _Episodes, cfg: ExperimentConfig, tokenizer: Any) -> list[dict]:
    """The task's rows, prompts tokenized with the chat template."""
    from areal.data.dataset import task_rows, tokenize_rows

    dataset = cfg.dataset
    if episodes.task.options is None and dataset.options:
        # The config's are its dataset.type's (arith's by default), not this task's.
        dataset = copy.copy(dataset)
        dataset.options = {}
    rows = task_rows(episodes.task, episodes.spec, dataset, cfg.seed)
    return tokenize_rows(rows, tokenizer, cfg.dataset.max_prompt_len)


def _ready_dir(cfg: ExperimentConfig, resume_from: Checkpoint | None) -> None:
    """The experiment directory of a fresh run (train.prepare_experiment made it ready for
    run_inline already): another run there is refused, or moved aside with overwrite=true."""
    from areal.run_dir import claim

    exp = cfg.exp_dir
    if resume_from is None and any((exp / n).exists() for n in ("metrics.jsonl", "checkpoints")):
        # A different config: ConfigError; overwrite=true: moved aside.
        overwrite, cfg.overwrite = cfg.overwrite, False
        cfg.resume = claim(exp, cfg.to_dict(), resume=cfg.resume, overwrite=overwrite)
        if cfg.resume:
            raise ConfigError(
                f"{exp} holds a run of this config: give a new trial_name=NAME or "
                "overwrite=true; to resume it: python -m areal.train --config FILE "
                "launcher.type=inline resume=true"
            )
    (exp / "logs").mkdir(parents=True, exist_ok=True)
    shutil.rmtree(exp / "weights", ignore_errors=True)  # no version of another run
    if not (exp / "config.yaml").exists():
        cfg.save(exp / "config.yaml")


def _add_engines(run: Run, model: Any, tokenizer: Any, resume_from: Checkpoint | None) -> None:
    """rollout.n_servers engines, started, into run.engines (closed with the run)."""
    import torch

    from areal.rollout.engine import DecodeEngine

    cfg, inf = run.cfg, run.cfg.inference
    lora = cfg.model.lora.enabled  # a LoRA checkpoint's model/ is the adapter: base + it
    dtype = getattr(torch, cfg.model.dtype)
    kwargs = dict(
        max_batch_size=inf.max_batch_size,
        max_total_tokens=inf.max_total_tokens,
        num_threads=max(1, inf.num_threads),
        weight_version=resume_from.version if resume_from else 0,
    )
    for k in range(cfg.rollout.n_servers):
        seed = cfg.seed + k  # as launch.server_command gives server k
        if isinstance(model, torch.nn.Module):  # a copy: the trainer updates the original
            own = copy.deepcopy(model).to(dtype)
            engine = DecodeEngine(own, tokenizer, seed=seed, **kwargs)
        else:
            model_dir = str(resume_from.model_dir) if resume_from and not lora else str(model)
            engine = DecodeEngine.from_dir(model_dir, dtype=dtype, seed=seed, **kwargs)
        run.engines.append(engine.start())
    if resume_from and lora:
        for engine in run.engines:
            ok, message, _ = engine.update_weights(str(resume_from.model_dir))
            assert ok, message


def _make_trainer(run: Run, model: torch.nn.Module | None, tokenizer: Any) -> Trainer:
    """The one trainer rank, on the caller's thread: over the model object given, or the
    backend trainer.backend builds from model.path; its controller the roles' one."""
    from areal.trainer.parallel import DataParallel
    from areal.worker import make_trainer, n_updates

    backend = None
    if model is not None:
        from areal.trainer.optimizer import OptimizerSpec
        from areal.trainer.torch_backend import TorchBackend

        cfg = run.cfg
        backend = TorchBackend(
            model,
            tokenizer=tokenizer,
            optimizer=OptimizerSpec.for_policy(cfg.trainer, n_updates(cfg)),
            dtype=cfg.model.dtype,
            temperature=cfg.rollout.temperature,
        )
    roles = run.roles

    def connect() -> BlockingRpc:
        assert roles.controller_rpc is not None, "the roles start before the trainer"
        return BlockingRpc(roles.controller_rpc, run.loop, lambda: roles.failure)

    return make_trainer(run.cfg, DataParallel(), connect, backend=backend)


def run_inline(cfg: ExperimentConfig, resume_from: Checkpoint | None = None) -> int:
    """launcher.type=inline: build from the config (the experiment directory prepared by
    train.prepare_experiment) and step to total_train_steps; the exit code, as a
    launcher's run()."""
    from areal.controller.failures import NO_PROGRESS_EXIT, NoProgress

    try:
        with build(cfg.model.path, None, cfg.dataset.type, cfg, resume_from=resume_from) as run:
            while run.version < cfg.total_train_steps:
                run.step()
        return 0
    except NoProgress as e:
        print(e, file=sys.stderr, flush=True)
        return NO_PROGRESS_EXIT
