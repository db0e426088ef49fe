"""`python -m areal.train --config FILE [key.sub=value ...]`: config -> launcher -> exit code.

1) load and validate the config (fast: nothing heavy is imported before this)
2) prepare the experiment directory: key, config snapshot, logs, the model
3) start every role (locally, as srun steps inside a SLURM allocation, or as Ray actors on a
   Ray cluster) and wait;
   when a role dies, the launcher calls `prepare_recovery` and starts them all again
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from areal.config import ConfigError, ExperimentConfig, load_config
from areal.process import exit_now

if TYPE_CHECKING:
    from areal.checkpoint import Checkpoint
    from areal.launcher.plan import Plan
    from areal.launcher.ray import RayNode
    from areal.launcher.slurm import Allocation
    from areal.tasks import Task


def prepare_experiment(cfg: ExperimentConfig, recovering: bool = False) -> Checkpoint | None:
    """Make the experiment directory ready for a fresh or resumed run; resolve the model.
    A directory holding another run is never overwritten (areal/run_dir.py).

    1) check the inputs  2) claim the directory  3) clear what the previous run left and trim
    its per-step files to the checkpoint  4) the key, the model, the config snapshot"""
    from areal.checkpoint import latest
    from areal.comm.registry import create_key
    from areal.preflight import check_disk, check_model_dir
    from areal.run_dir import claim

    task = _check_inputs(cfg)
    exp = cfg.exp_dir
    if not recovering:  # a run there is resumed, moved aside (overwrite=true) or refused
        overwrite, cfg.overwrite = cfg.overwrite, False  # done once: recoveries resume
        cfg.resume = claim(exp, cfg.to_dict(), resume=cfg.resume, overwrite=overwrite)
    exp.mkdir(parents=True, exist_ok=True)
    ckpt = latest(exp) if cfg.resume else None
    if ckpt is not None and ckpt.version >= cfg.total_train_steps and not recovering:
        return ckpt  # a finished run: main says so, and nothing in it changes
    _clear_previous_run(exp, cfg.resume, recovering)
    _trim_to_checkpoint(exp, ckpt, cfg.resume)
    (exp / "logs").mkdir()
    create_key(exp)
    if not cfg.model.path:
        cfg.model.path = str(_tiny_model(cfg, task))
    check_model_dir(cfg.model.path)
    check_disk(
        cfg.fileroot, cfg.model.path, save_dtype=cfg.trainer.save_dtype, lora=cfg.model.lora.enabled
    )
    cfg.save(exp / "config.yaml")
    return ckpt


def _check_inputs(cfg: ExperimentConfig) -> Task:
    """The task, its rows, the workflow and a given model: each a user mistake best reported
    now, in milliseconds, before the experiment directory changes."""
    from areal.data.dataset import load_rows
    from areal.preflight import check_model_dir
    from areal.tasks import load_task

    task = load_task(cfg.dataset.type)  # a task of the user's is imported first here
    if cfg.dataset.path:
        # Every role must find the file whatever its working directory.
        cfg.dataset.path = str(Path(cfg.dataset.path).resolve())
    # A bad file or task is a user mistake best reported now, before anything else.
    n = len(load_rows(cfg.dataset, cfg.seed))
    if task.needs_path:
        print(f"areal: {n} {task.name} problems in {cfg.dataset.path}")
    from areal.workflow import resolve

    try:  # a misspelt workflow is a user mistake: say so now, not in the controller's log
        resolve(cfg.rollout.workflow)
    except ValueError as e:
        raise ConfigError(str(e)) from e
    if cfg.model.path:  # before the directory changes: a wrong model is refused in ms
        check_model_dir(cfg.model.path)
    return task


def _clear_previous_run(exp: Path, resume: bool, recovering: bool) -> None:
    """Neither a fresh nor a resumed run may find the previous run's addresses, weights or
    logs; a resumed run keeps the stopped run's logs aside."""
    if resume and not recovering and (exp / "logs").exists():
        # The stopped run's logs stay (a recovery keeps its own in logs.attempt{n-1}).
        (exp / "logs").rename(exp / time.strftime("logs.resumed-%Y%m%d-%H%M%S"))
    for name in ("weights", "logs"):
        shutil.rmtree(exp / name, ignore_errors=True)
    if not resume:
        for old in exp.glob("logs.attempt*"):  # an earlier run's recoveries
            shutil.rmtree(old, ignore_errors=True)
    for entry in (exp / "registry").glob("*/"):
        shutil.rmtree(entry, ignore_errors=True)


def _trim_to_checkpoint(exp: Path, ckpt: Checkpoint | None, resume: bool) -> None:
    """Without a checkpoint, the previous run's checkpoints, events and per-step files go;
    with one, the per-step lines after it go (those steps will be trained again)."""
    from areal.checkpoint import checkpoints_root
    from areal.events import events_dir

    # One line per step in each (trainer/worker.py); the timeline's spans per role.
    per_step = [exp / "metrics.jsonl", exp / "batches.jsonl"]
    if ckpt is None:
        if resume:
            print(f"areal: no checkpoint in {exp}; starting afresh")
        shutil.rmtree(checkpoints_root(exp), ignore_errors=True)
        shutil.rmtree(events_dir(exp), ignore_errors=True)
        for path in per_step:
            path.unlink(missing_ok=True)
        return
    print(f"areal: resuming from {ckpt.path}")
    # The timeline keeps every span: it shows the time spent, lost work included.
    for path in filter(Path.exists, per_step):
        lines = [
            ln
            for ln in path.read_text().splitlines()
            if ln.strip() and json.loads(ln)["step"] <= ckpt.version
        ]
        path.write_text("".join(ln + "\n" for ln in lines))


def _tiny_model(cfg: ExperimentConfig, task: Task) -> Path:
    """The tiny model for a config without model.path: made once, then cached."""
    from areal.models.cache import CACHE_ENV, cache_dir, tiny_model

    m = cfg.model
    # A task without warm-up data (code) gets the arith model: it knows digits and turns.
    warm = cfg.dataset.type if task.warmup is not None else "arith"
    path = tiny_model(
        seed=cfg.seed,
        hidden=m.tiny_hidden,
        layers=m.tiny_layers,
        heads=m.tiny_heads,
        warmup_steps=m.tiny_warmup_steps,
        task=warm,
        options=cfg.dataset.options if warm == cfg.dataset.type else {},
        # On a cluster every node must see it: the run's shared storage, not this node's
        # cache, unless $AREAL_CACHE_DIR names one (the same cache under every launcher).
        root=cache_dir()
        if cfg.launcher.type in ("local", "inline") or os.environ.get(CACHE_ENV)
        else Path(cfg.fileroot) / "models",
    )
    print(f"areal: using the tiny model {path}")
    return path


def prepare_recovery(cfg: ExperimentConfig, n: int) -> None:
    """Ready the experiment directory for the n-th automatic restart of the run: exactly
    what resume=true does, keeping the failed attempt's logs in logs.attempt{n-1}/."""
    logs = cfg.exp_dir / "logs"
    if logs.exists():
        logs.rename(cfg.exp_dir / f"logs.attempt{n - 1}")
    cfg.resume = True  # the roles read it from the config.yaml written below
    prepare_experiment(cfg, recovering=True)


def plan_run(cfg: ExperimentConfig) -> tuple[Plan, Allocation | list[RayNode] | None]:
    """The placement of `cfg` (and where: the SLURM allocation, or the Ray nodes); sets
    rollout.n_servers and trainer.parallel.dp to what it placed."""
    from areal.launcher.plan import plan_sections

    alloc = None
    sections = plan_sections(cfg)  # the sections placement reads, as the launchers hand them
    if cfg.launcher.type in ("local", "inline"):  # inline: one process, as local plans it
        from areal.launcher.local import local_plan

        plan = local_plan(cfg.launcher.gpus_per_node or 0, **sections)
    elif cfg.launcher.type == "ray":
        from areal.launcher.ray import plan_on_ray

        plan, alloc = plan_on_ray(cfg)
    else:
        from areal.launcher.plan import make_plan
        from areal.launcher.slurm import current_allocation, in_allocation, plan_in_allocation

        if in_allocation() or not cfg.launcher.dry_run:
            alloc = current_allocation()
            plan = plan_in_allocation(cfg, alloc)
        else:
            # A dry run outside an allocation plans for the nodes the config asks for.
            lc = cfg.launcher
            if lc.nodes is None:
                raise ConfigError(
                    "a dry run outside a SLURM allocation needs the cluster's size: add "
                    "--nodes N --gpus-per-node G (or launcher.nodes / launcher.gpus_per_node)"
                )
            plan = make_plan(
                [f"node{i}" for i in range(lc.nodes)], lc.gpus_per_node or 0, **sections
            )
    if plan.n_servers != cfg.rollout.n_servers:
        # With GPUs the servers are counted by the placement, not by the config.
        print(
            f"areal: rollout.n_servers={plan.n_servers} "
            f"(inference GPUs / inference.tp_size; the config said {cfg.rollout.n_servers})"
        )
        cfg.rollout.n_servers = plan.n_servers
    par = cfg.trainer.parallel
    if plan.world_size != par.world_size:
        # Likewise the trainer ranks: one per training GPU, tp * pp of them per replica.
        dp = plan.world_size // (par.tp * par.pp)
        print(
            f"areal: trainer.parallel.dp={dp} (training GPUs / (tp * pp); the config said {par.dp})"
        )
        par.dp = dp
    return plan, alloc


def check_loggers_installed(cfg: ExperimentConfig) -> None:
    """A configured logger whose package is missing is a setup mistake: say so before the
    run starts (a logger that fails while running only warns)."""
    import importlib.util

    mode = cfg.stats.wandb.mode
    if mode != "disabled" and importlib.util.find_spec("wandb") is None:
        raise ConfigError(
            f"stats.wandb.mode={mode} needs the wandb package: pip install 'areal[wandb]' "
            "(or wandb), or set stats.wandb.mode=disabled"
        )


def setup_lines(cfg: ExperimentConfig) -> list[str]:
    """The objective, and what is on beyond the paper's default: LoRA, a reference model."""
    from areal.trainer.optimizer import OptimizerSpec
    from areal.trainer.ppo_config import PPOConfig

    objective = cfg.ppo.summary()
    default = PPOConfig().with_lengths(cfg.rollout.max_new_tokens).summary()
    lines = [
        f"objective {objective}"
        + ("" if objective == default else " (not the paper's default decoupled PPO)")
    ]
    lora = cfg.model.lora
    if lora.enabled:
        lines.append(
            f"LoRA on: rank {lora.rank}, alpha {lora.alpha:g} on {','.join(lora.target_modules)}"
            "; the base stays frozen, weights/vN hold adapters (python -m areal.export merges)"
        )
    if cfg.ppo.kl_coef:
        ref = cfg.ref_model.path or "the policy's initial weights"
        lines.append(f"reference model on: {ref} (ppo.kl_coef={cfg.ppo.kl_coef:g})")
    if cfg.ppo.adv_estimator == "gae":
        n_updates = cfg.total_train_steps * cfg.ppo.n_minibatches  # as areal/worker.py's
        critic, opt = cfg.critic, OptimizerSpec.for_critic(cfg.trainer, cfg.critic, n_updates)
        clip = "off" if critic.value_clip is None else f"{critic.value_clip:g}"
        lines.append(
            f"critic on: {critic.path or 'the policy initial weights'} + a value head, "
            f"lr {opt.lr:g}, value clip {clip}"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m areal.train", description="Run an asynchronous RL experiment."
    )
    parser.add_argument("--config", help="YAML config file (default: built-in defaults)")
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="print the placement plan and start nothing (= launcher.dry_run=true)",
    )
    parser.add_argument("--nodes", type=int, help="= launcher.nodes (nodes to plan for)")
    parser.add_argument("--gpus-per-node", type=int, help="= launcher.gpus_per_node")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.lr=1e-3")
    args = parser.parse_args(argv)
    overrides = list(args.overrides)
    if args.dry_run:
        overrides.append("launcher.dry_run=true")
    if args.nodes is not None:
        overrides.append(f"launcher.nodes={args.nodes}")
    if args.gpus_per_node is not None:
        overrides.append(f"launcher.gpus_per_node={args.gpus_per_node}")
    try:
        cfg = load_config(args.config, overrides)
        check_loggers_installed(cfg)
        plan, alloc = plan_run(cfg)
        if cfg.launcher.dry_run:
            described = plan.describe()
            if cfg.launcher.type == "ray":
                from areal.launcher.ray import describe

                described = describe(plan, alloc)  # type: ignore[arg-type]
            print(f"areal: dry run ({cfg.launcher.type}); placement plan:\n{described}")
            return 0
        ckpt = prepare_experiment(cfg)
    except ConfigError as e:
        print(f"areal: config error: {e}", file=sys.stderr)
        return 2
    print(f"areal: experiment directory {cfg.exp_dir}")
    for line in setup_lines(cfg):
        print(f"areal: {line}")
    if ckpt is not None and ckpt.version >= cfg.total_train_steps:
        print(
            f"areal: the run in {cfg.exp_dir} is finished (its checkpoint has {ckpt.version} of "
            f"{cfg.total_train_steps} steps); nothing was changed. A new trial_name=NAME starts "
            "another run; resume=true with a larger total_train_steps trains this one further"
        )
        return 0
    if cfg.launcher.type == "inline":  # every role in this process (areal/inline.py)
        from areal.inline import run_inline

        return run_inline(cfg, ckpt)
    if cfg.launcher.type == "ray":
        from areal.launcher.ray import RayLauncher

        print(f"areal: Ray cluster at {cfg.launcher.ray_address}", flush=True)
        return RayLauncher(cfg, plan, alloc).run(  # type: ignore[arg-type]
            resume=lambda n: prepare_recovery(cfg, n)
        )
    if alloc is None:
        from areal.launcher.local import LocalLauncher

        return LocalLauncher(cfg).run(resume=lambda n: prepare_recovery(cfg, n))
    from areal.launcher.slurm import SlurmLauncher

    print(f"areal: SLURM job {alloc.job_id}; placement plan:\n{plan.describe()}", flush=True)
    return SlurmLauncher(cfg, alloc, plan).run(resume=lambda n: prepare_recovery(cfg, n))


if __name__ == "__main__":
    exit_now(main())
