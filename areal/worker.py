"""Start one role of a run: `python -m areal.worker --role ROLE [--index K] --exp-dir DIR`.

The launcher starts every role this way; starting one by hand (for debugging) works the
same, given a running experiment directory: the role reads DIR/config.yaml, finds its
peers in DIR/registry/, and registers its own address there. Trainer ranks of a
data-parallel trainer (trainer.parallel.dp > 1) also read RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT and LOCAL_RANK, and --index must equal RANK (areal/trainer/parallel.py).
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys

from areal import events, rolelog
from areal.comm.registry import Registry, load_key
from areal.comm.rpc import RpcServer
from areal.config import ExperimentConfig, load_config
from areal.events import events_path
from areal.process import exit_now
from areal.tokenizer import load_tokenizer

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
    from areal.controller.controller import run_controller
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
        from areal.trainer.worker import run_trainer

        run_trainer(cfg, key, args.index)  # the index is the trainer rank


if __name__ == "__main__":
    main()
    exit_now()
