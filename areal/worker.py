"""Start one role of a run: `python -m areal.worker --role ROLE [--index K] --exp-dir DIR`.

Each role is built here from the config, once: the controller (make_controller) and a
trainer rank (make_trainer, its models from make_backend, make_reference and make_critic,
its per-step settings a StepPlan) take the sections and objects they use, not the config;
areal/inline.py builds the same roles with these functions in one process.

The launcher starts every role this way; starting one by hand (for debugging) works the
same, given a running experiment directory: the role reads DIR/config.yaml, finds its
peers in DIR/registry/, and registers its own address there. Trainer ranks of a
data-parallel trainer (trainer.parallel.dp > 1) also read RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT and LOCAL_RANK, and --index must equal RANK (areal/trainer/parallel.py).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from typing import TYPE_CHECKING

from areal import events, rolelog
from areal.comm.registry import Registry, load_key
from areal.comm.rpc import RpcServer
from areal.config import ExperimentConfig, load_config
from areal.events import events_path
from areal.process import exit_now
from areal.tokenizer import load_tokenizer

if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path

    from transformers import PreTrainedTokenizerBase

    from areal.checkpoint import Checkpoint
    from areal.comm.rpc import RpcClient, SyncRpcClient
    from areal.controller.controller import Controller
    from areal.trainer.backend import TrainerBackend
    from areal.trainer.critic import TorchCritic
    from areal.trainer.parallel import DataParallel
    from areal.trainer.worker import StepPlan, Trainer
    from areal.workflow import Workflow

# "server" registers inference server k and becomes it (areal/rollout/launch.py).
ROLES = ("server", "controller", "rollout", "reward", "trainer")


async def _serve_until_stopped(server: RpcServer) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, server.close)
    await server.serve()


async def _rollout(cfg: ExperimentConfig, index: int, key: bytes) -> None:
    from areal.rollout.auth import api_key
    from areal.rollout.backends import load_backend, start_adapter
    from areal.rollout.launch import server_log_path, wait_for_server
    from areal.rollout.worker import RolloutWorker

    registry = Registry(cfg.exp_dir)
    timeout = cfg.inference.startup_timeout_s
    store = tokenizer = reward = None
    if cfg.rollout.data_plane == "pull":  # it decodes, grades and holds its trajectories
        from areal.comm.rpc import RpcClient
        from areal.data_plane import TrajectoryStore

        store = TrajectoryStore(f"rollout{index}")
        # Loaded on a thread while the server starts.
        tokenizer = asyncio.get_running_loop().run_in_executor(None, load_tokenizer, cfg.model.path)
        reward = RpcClient(registry.lookup("reward", 0, timeout=timeout + 60), key)
    url = registry.lookup("server", index, timeout=timeout)
    fatal: list[Exception] = []  # recovery gave up on the server: this process ends with it
    worker = RolloutWorker(
        url,
        client_factory=load_backend(cfg.inference.backend).client(),
        interruptible=cfg.rollout.interruptible,
        # A restarted server registers its new URL here.
        find_server=lambda: registry.lookup("server", index, timeout=timeout),
        update_timeout_s=cfg.inference.update_timeout_s,
        update_retries=cfg.inference.update_retries,
        recovery_timeout_s=cfg.inference.startup_timeout_s
        + cfg.inference.update_timeout_s * cfg.inference.update_retries,
        on_fatal=lambda e: (fatal.append(e), server.close()),
        api_key=api_key(cfg.exp_dir),
        store=store,
        reward=reward,
    )
    # On failure: the server's command line and the tail of logs/server{index}.log.
    await wait_for_server(
        worker.client, cfg.inference.startup_timeout_s, server_log_path(cfg.exp_dir, index)
    )
    if tokenizer is not None:
        worker.tokenizer = await tokenizer
    adapter = start_adapter(cfg)
    if adapter is not None:  # a resumed LoRA run: the server started from the base
        await worker.update_weights(*adapter)
    server = RpcServer(key)
    for name in RolloutWorker.RPC_METHODS:
        server.register(name, getattr(worker, name))
    if store is not None:
        store.address = server.address
        for name in store.RPC_METHODS:
            server.register(name, getattr(store, name))
    registry.register("rollout", index, server.address)
    try:
        await _serve_until_stopped(server)
    finally:
        await worker.client.close()
        if reward is not None:
            reward.close()
    if fatal:
        raise fatal[0]


async def _reward(cfg: ExperimentConfig, index: int, key: bytes) -> None:
    from areal.reward.service import RewardService

    service = RewardService(cfg.reward)
    server = RpcServer(key)
    server.register("grade", service.grade)
    server.register("stats", service.stats)
    Registry(cfg.exp_dir).register("reward", index, server.address)
    try:
        await _serve_until_stopped(server)
    finally:
        service.close()


def _controller(cfg: ExperimentConfig, key: bytes) -> None:
    from areal.checkpoint import latest
    from areal.controller.failures import NO_PROGRESS_EXIT, NoProgress
    from areal.data.dataset import load_rows, tokenize_rows

    tokenizer = load_tokenizer(cfg.model.path)
    rows = tokenize_rows(load_rows(cfg.dataset, cfg.seed), tokenizer, cfg.dataset.max_prompt_len)
    resume_from = latest(cfg.exp_dir) if cfg.resume else None
    try:
        asyncio.run(run_controller(cfg, tokenizer, rows, key, resume_from))
    except NoProgress as e:
        print(e, file=sys.stderr, flush=True)  # the end of its log, which the launcher shows
        sys.exit(NO_PROGRESS_EXIT)


# ---- the roles' objects, built from the config ----------------------------------------------


def make_controller(
    cfg: ExperimentConfig,
    rows: list[dict],
    tokenizer: PreTrainedTokenizerBase,
    workers: list[RpcClient],
    reward: RpcClient | None,
    workflow: Workflow | None = None,
    data_plane: str | None = None,
) -> Controller:
    """The controller of cfg's run over its rollout workers' and reward service's clients
    (run_controller's, and areal.build's over in-process ones)."""
    from areal.controller.controller import Controller
    from areal.rollout.backends import load_backend

    return Controller(
        rows, tokenizer, workers, reward, workflow, data_plane,
        rollout=cfg.rollout,
        batch_size=cfg.trainer.batch_size,
        max_staleness=cfg.max_staleness,
        seed=cfg.seed,
        exp_dir=cfg.exp_dir,
        ranks_per_server=load_backend(cfg.inference.backend).group_ranks(cfg.inference),
        dynamic_sampling=cfg.ppo.dynamic_sampling,
    )  # fmt: skip


def step_plan(cfg: ExperimentConfig) -> StepPlan:
    """What the trainer's every step reads of cfg (trainer/worker.py's StepPlan)."""
    from areal.trainer.worker import StepPlan

    return StepPlan(
        ppo=cfg.ppo,
        max_new_tokens=cfg.rollout.max_new_tokens,
        max_tokens_per_mb=cfg.trainer.mb_spec.max_tokens_per_mb,
        min_n_mbs=cfg.trainer.mb_spec.min_n_mbs,
        seed=cfg.seed,
        value_clip=cfg.critic.value_clip,
        exp_dir=cfg.exp_dir,
        total_train_steps=cfg.total_train_steps,
        save_freq_steps=cfg.trainer.save_freq_steps,
        save_freq_s=cfg.trainer.save_freq_s,
        distributed=cfg.weights.transport == "distributed",
    )


def n_updates(cfg: ExperimentConfig) -> int:
    """The run's optimizer steps: one per minibatch (OptimizerSpec's warm-up is a fraction)."""
    return cfg.total_train_steps * cfg.ppo.n_minibatches


def make_backend(
    cfg: ExperimentConfig, model_dir: str | Path, dp: DataParallel
) -> tuple[TrainerBackend, DataParallel]:
    """The backend cfg.trainer.backend names (trainer/backends/: the registry imports the
    one asked for, lazily: the torch path never imports megatron), and `dp` narrowed to its
    data-parallel group (megatron: the world is tp * pp * dp ranks, gradients are summed
    over replicas only)."""
    from areal.trainer.backends import load_backend
    from areal.trainer.optimizer import OptimizerSpec

    spec = load_backend(cfg.trainer.backend)
    return spec.build(cfg, model_dir, dp, OptimizerSpec.for_policy(cfg.trainer, n_updates(cfg)))


def make_reference(cfg: ExperimentConfig, dp: DataParallel) -> TrainerBackend:
    """The frozen reference policy of ppo.kl_coef (ref_model.path, or the policy's initial
    weights): a torch backend whatever trains, used for forwards only (its optimizer never
    steps, so Adam's state is never allocated). With megatron's tensor parallelism each
    rank holds the whole reference model."""
    from areal.trainer.optimizer import OptimizerSpec
    from areal.trainer.torch_backend import TorchBackend, rank_device

    ref = TorchBackend.from_dir(
        cfg.ref_model.path or cfg.model.path,
        optimizer=OptimizerSpec.for_policy(cfg.trainer, n_updates(cfg)),
        dtype=cfg.model.dtype,
        temperature=cfg.rollout.temperature,
        device=rank_device(dp),
    )
    ref.model.requires_grad_(False)
    return ref


def make_critic(cfg: ExperimentConfig, dp: DataParallel) -> TorchCritic:
    """The critic of ppo.adv_estimator=gae: a value model on critic.path (or the policy's
    initial weights, also after a resume: the checkpoint then overwrites it), its optimizer
    critic's settings, each null one the trainer's; the warm-up of the trainer's schedule.
    ExperimentConfig refuses it with LoRA and data parallelism, a backend that cannot train
    beside it in its own check."""
    from areal.trainer.critic import TorchCritic
    from areal.trainer.optimizer import OptimizerSpec
    from areal.trainer.torch_backend import rank_device

    return TorchCritic.from_dir(
        cfg.critic.path or cfg.model.path,
        optimizer=OptimizerSpec.for_critic(cfg.trainer, cfg.critic, n_updates(cfg)),
        dtype=cfg.model.dtype,
        device=rank_device(dp),
    )


def make_trainer(
    cfg: ExperimentConfig,
    dp: DataParallel,
    connect: Callable[[], SyncRpcClient],
    key: bytes = b"",
    backend: TrainerBackend | None = None,
) -> Trainer:
    """One rank's Trainer: the backend given (a model object, areal.build), or the one
    trainer.backend builds from model.path (resumed from the latest checkpoint with
    cfg.resume); global rank 0 reaches the controller through connect() (an RPC client, or
    areal/inline.py's in-process stand-in); `key` signs the pulls from the holders."""
    import torch

    from areal.checkpoint import latest
    from areal.cores import role_cores
    from areal.data_plane import Puller
    from areal.trainer.broadcast import WeightBroadcaster
    from areal.trainer.worker import Metrics, Trainer, load_trainer_part

    torch.manual_seed(cfg.seed)
    cores = role_cores(cfg.trainer.num_threads)
    plan = step_plan(cfg)
    # Every rank loads the same weights and optimizer state, so that identical summed
    # gradients keep them identical; rank 0 alone writes them back.
    resume_from = latest(cfg.exp_dir) if cfg.resume else None
    model_dir = resume_from.model_dir if resume_from else cfg.model.path
    if backend is None:
        backend, dp = make_backend(cfg, model_dir, dp)
    elif resume_from is not None:
        raise ValueError("a run resumes from its checkpoint's weights, not a model object")
    trainer = Trainer(plan, backend, dp, None, cores, Puller(key, cfg.exp_dir / "logs"))
    # The reference policy stays the initial weights, a resumed run's too.
    trainer.ref = make_reference(cfg, dp) if cfg.ppo.kl_coef > 0 else None
    # PPO with a critic: the value model and its optimizer (a resume restores both below).
    trainer.critic = make_critic(cfg, dp) if cfg.ppo.adv_estimator == "gae" else None
    cores.follow(backend.model)  # borrows idle servers' cores layer by layer
    if resume_from:
        load_trainer_part(backend, resume_from.path, trainer.critic)
        trainer.version = resume_from.version
    if dp.is_main:
        trainer.controller = connect()
        trainer.metrics = Metrics(cfg.exp_dir, dp)
        if plan.distributed:
            trainer.broadcaster = WeightBroadcaster(cfg, model_dir, trainer.version)
    return trainer


def run_trainer(cfg: ExperimentConfig, key: bytes, index: int = 0) -> None:
    """One trainer rank; `index` is its rank in the trainer world (0 without parallelism)."""
    from areal.comm.rpc import SyncRpcClient
    from areal.trainer.parallel import init_data_parallel
    from areal.trainer.worker import train

    par = cfg.trainer.parallel
    dp = init_data_parallel(par.dp, index, par.timeout_s, model_parallel=par.tp * par.pp)

    def connect() -> SyncRpcClient:
        wait_s = cfg.inference.startup_timeout_s + 120  # the controller waits for the servers
        address = Registry(cfg.exp_dir).lookup("controller", 0, timeout=wait_s)
        return SyncRpcClient(address, key)

    try:
        train(make_trainer(cfg, dp, connect, key))
    finally:
        dp.close()


async def run_controller(
    cfg: ExperimentConfig,
    tokenizer: PreTrainedTokenizerBase,
    rows: list[dict],
    key: bytes,
    resume_from: Checkpoint | None = None,
) -> None:
    """The controller role: its server, admission loop and state until the launcher stops
    it; NoProgress once episodes only fail."""
    from areal.comm.rpc import RpcClient
    from areal.comm.wire import unpack
    from areal.controller.failures import NoProgress

    log = logging.getLogger("areal.controller")
    registry = Registry(cfg.exp_dir)
    # Rollout workers register once their server is healthy, which can take minutes.
    wait_s = cfg.inference.startup_timeout_s + 60
    addresses = registry.lookup_all("rollout", cfg.rollout.n_servers, timeout=wait_s)
    workers = [RpcClient(a, key) for a in addresses]
    reward = RpcClient(registry.lookup("reward", 0, timeout=wait_s), key)
    controller = make_controller(cfg, rows, tokenizer, workers, reward)
    if resume_from is not None:
        controller.load_state_dict(
            unpack(resume_from.controller_state.read_bytes()), resume_from.version
        )
        log.info(
            "resumed at version %d with %d ready groups",
            resume_from.version,
            len(controller.buffer),
        )
    server = RpcServer(key)
    server.register("get_batch", controller.get_batch)
    server.register("weights_ready", controller.weights_ready)
    server.register("save_state", controller.save_state)
    controller.server = server
    controller.store.address = server.address
    for name in controller.store.RPC_METHODS:
        server.register(name, getattr(controller.store, name))
    serve = asyncio.create_task(server.serve())
    registry.register("controller", 0, server.address)
    admit = asyncio.create_task(controller.admit_loop())
    # The run ends when the trainer has finished and the launcher stops us.
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    stopped = asyncio.create_task(stop.wait())
    stalled = asyncio.create_task(controller.stalled.wait())
    try:
        done, _ = await asyncio.wait(
            {serve, admit, stopped, stalled}, return_when=asyncio.FIRST_COMPLETED
        )
        if stalled in done:
            raise NoProgress(controller.no_progress)
        if stopped not in done:  # a loop that ends by itself is a failure: surface it
            for t in done:
                t.result()
            raise RuntimeError("a controller loop ended unexpectedly")
    finally:
        admit.cancel()
        stopped.cancel()
        stalled.cancel()
        server.close()
        await asyncio.gather(serve, admit, stopped, stalled, return_exceptions=True)
        controller.pool.close()
        for c in [*workers, reward]:
            c.close()
        await controller.workflow.aclose()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--role", choices=ROLES, required=True)
    parser.add_argument("--index", type=int, default=0)
    parser.add_argument("--exp-dir", required=True)
    args = parser.parse_args(argv)
    name = f"{args.role}{args.index}"  # as logs/{name}.log and events/{name}.jsonl
    rolelog.setup(name)
    cfg = load_config(f"{args.exp_dir}/config.yaml")
    # Servers configure their own (the embedded server process); every other role records
    # its spans and, rollout workers and the reward service included, its CPU samples.
    if cfg.stats.events and args.role != "server":
        events.configure(events_path(cfg.exp_dir, name), name)
    if args.role == "server":
        from areal.rollout.launch import exec_server

        exec_server(cfg, args.index)
    key = load_key(args.exp_dir)
    if args.role == "rollout":
        asyncio.run(_rollout(cfg, args.index, key))
    elif args.role == "reward":
        asyncio.run(_reward(cfg, args.index, key))
    elif args.role == "controller":
        _controller(cfg, key)
    else:
        run_trainer(cfg, key, args.index)  # the index is the trainer rank


if __name__ == "__main__":
    main()
    exit_now()
