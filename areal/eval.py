"""`python -m areal.eval --model DIR|RUN_DIR [--data FILE | --task T] --n-samples 32`: pass@k.

    the task's rows (--task, else --config's dataset.type, else inferred from --data)
      --> n episodes per problem of the workflow (--workflow, else --config's
          rollout.workflow, else the single-turn default), each run as the controller runs
          it (areal.workflow: EpisodeRunner, RolloutEngine with one sample per episode):
            engine.generate --> a RolloutWorker (the rollout role's, in this process) -->
                                the backend's client --> inference server (--backend's,
                                started here: embedded, vllm or sglang; or --server-url)
            engine.grade    --> RewardService (the task's grader, the same process pool and
                                time limits as training; 1 right, 0 wrong)
      --> an episode passes when a sample of it has a reward > 0 (agents grade themselves:
          the examples give +5 right, -5 wrong); a rejected or timed-out episode fails
      --> pass@1 (mean over samples, then problems) and pass@k (unbiased estimator)
      --> table + JSON

pass@k = E_problems[1 - C(n - c, k) / C(n, k)] with n samples of which c are correct
(Chen et al., 2021): unbiased, unlike the fraction of problems solved within k samples.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from areal.config import ConfigError, DatasetConfig, RewardConfig, RolloutConfig, load_config
from areal.rollout.auth import API_KEY_ENV

if TYPE_CHECKING:
    from areal.trajectory import Trajectory

DEFAULT_SAMPLING = {"max_new_tokens": 1024, "temperature": 0.6, "top_p": 0.95}


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of k samples drawn from n (c correct) is correct."""
    assert 0 <= c <= n and 1 <= k <= n
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def summarise(correct: list[list[bool]], ks: list[int]) -> dict[str, float]:
    n = len(correct[0])
    out = {"pass@1": sum(sum(c) / n for c in correct) / len(correct)}
    for k in ks:
        if 1 < k <= n:
            out[f"pass@{k}"] = sum(pass_at_k(n, sum(c), k) for c in correct) / len(correct)
    return out


def infer_task(path: str, max_records: int = 1000) -> str:
    """The first task read from a file (code, math, ...) that reads one of its records."""
    from areal.data.files import BadRecord, read_records
    from areal.tasks import load_task, names

    from_file = [load_task(n) for n in names() if load_task(n).needs_path]
    for i, (_, record) in enumerate(read_records(path)):
        if i == max_records:
            break
        if isinstance(record, dict) and not isinstance(record, BadRecord):
            for task in from_file:
                try:
                    task.from_record(record)
                except ValueError:
                    continue
                return task.name
    raise ConfigError(
        f"{path}: no record that a task reads ("
        + "; ".join(f"{t.name}: {t.record_fields}" for t in from_file)
        + "); pass --task"
    )


def load_problems(args: argparse.Namespace) -> list[dict]:
    """The task's rows: dataset.n_problems = --max-problems (32) of a task made in code."""
    from areal.data.dataset import load_rows

    dataset = dataclasses.replace(
        args.dataset,
        n_problems=args.max_problems or 32,
        max_prompt_len=args.max_prompt_len,
    )
    rows = load_rows(dataset, args.seed)
    return rows[: args.max_problems] if args.max_problems else rows


def episode_passed(trajs: list[Trajectory] | None) -> bool:
    """A sample of the episode earned a positive reward (None: declined, a failure)."""
    return bool(trajs) and max(t.reward for t in trajs) > 0


async def sample_and_grade(
    args: argparse.Namespace, rows: list[dict], url: str
) -> list[list[bool]]:
    from areal.reward.service import RewardService
    from areal.rollout.backends import load_backend
    from areal.rollout.launch import wait_for_server
    from areal.rollout.worker import RolloutWorker
    from areal.trajectory import Trajectory
    from areal.workflow import EpisodeError, EpisodeRunner, RolloutEngine, load_workflow

    failed: list[Exception] = []  # the server's errors: they end the evaluation
    worker = RolloutWorker(
        url,
        client_factory=load_backend(args.backend).client(),
        api_key=args.api_key,
        recovery_timeout_s=0,  # a dead server ends the evaluation: nothing restarts it
        on_fatal=failed.append,
    )
    service = RewardService(args.reward)
    workflow = load_workflow(args.rollout.workflow, args.rollout)
    runner = EpisodeRunner(workflow, args.rollout.episode_timeout_s)
    done = 0

    async def generate(group_id: int, prompt_ids: list[int], n: int, sampling: dict):
        try:
            wire = await worker.generate(group_id, prompt_ids, n, sampling, start_version=0)
            trajs = [Trajectory.from_wire(w) for w in wire]
            if not all(t.finish_reason for t in trajs):  # the worker marked the server down
                raise ConnectionError(f"inference server {url} died during the evaluation")
        except Exception as e:  # an agent would see an HTTP 500 and fail only its episode
            failed.append(e)
            raise
        return trajs

    async def episode(index: int, row: dict) -> bool:
        engine = RolloutEngine(
            tokenizer=args.tokenizer,
            group_size=1,  # one sample (single turn) or one agent episode: one of the n
            sampling_params=args.sampling,
            group_id=index,
            start_version=0,
            generate_fn=lambda ids, n, sampling: generate(index, ids, n, sampling),
            grade_fn=service.grade,
        )
        try:
            return episode_passed(await runner.run(engine, row))
        except EpisodeError:  # counted and logged by the runner
            if failed:  # not the episode's fault: no verdict can be trusted
                raise failed[0] from None
            return False

    async def one(index: int, row: dict) -> list[bool]:
        nonlocal done
        # Graded as each episode ends, while others still generate.
        passed = await asyncio.gather(*(episode(index, row) for _ in range(args.n_samples)))
        done += 1
        print(f"\r{done}/{len(rows)} problems", end="", file=sys.stderr, flush=True)
        return list(passed)

    try:
        await wait_for_server(
            worker.client, args.startup_timeout_s, args.server_log, args.server_proc
        )
        limit = asyncio.Semaphore(args.max_concurrent)

        async def bounded(index: int, row: dict) -> list[bool]:
            async with limit:
                return await one(index, row)

        results = await asyncio.gather(*(bounded(i, r) for i, r in enumerate(rows)))
        args.reward_counts = await service.stats()
        args.episode_counts = dict(runner.counts)
        args.workflow_stats = workflow.stats()
        print(file=sys.stderr)
        return results
    finally:
        await workflow.aclose()
        await worker.client.close()
        service.close()


def start_server(args: argparse.Namespace, log_path: Path) -> tuple[subprocess.Popen, str]:
    """--backend's server for --model on a free loopback port, as the launcher starts one
    (the backend's command line; its version check), answering only this evaluation."""
    from areal.comm import net
    from areal.rollout.backends import load_backend
    from areal.rollout.launch import start_server_process

    backend = load_backend(args.backend)
    port = net.free_port("127.0.0.1")
    args.api_key = secrets.token_hex(16)
    cmd, env = backend.command(args.cfg, 0, "127.0.0.1", port, args.api_key)
    if args.cfg.inference.check_version and (problem := backend.version_problem(cmd[0])):
        raise ConfigError(problem)
    return start_server_process(cmd, log_path, env), f"http://127.0.0.1:{port}"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m areal.eval", description=__doc__.splitlines()[0])
    p.add_argument(
        "--model", required=True, help="HF model directory (tokenizer; and served), or a run's "
        "directory: its latest checkpoint, with the run's task, workflow and sampling",
    )  # fmt: skip
    p.add_argument("--data", help="JSON/JSONL/parquet file of problems (default: --config's)")
    p.add_argument(
        "--task", help='dataset.type: a task (arith, longtail, math, code) or "package.module:'
        'object"; default: --config\'s, else inferred from the data',
    )  # fmt: skip
    p.add_argument(
        "--config", help="a training config: its rollout.workflow (and agent settings), "
        "dataset and reward sections are the defaults here",
    )  # fmt: skip
    p.add_argument("--workflow", help="package.module:object (default: --config's, single turn)")
    p.add_argument("--n-samples", type=int, default=32, help="samples per problem (n)")
    p.add_argument("--k", default="1,4,8,16,32", help="comma-separated k of pass@k (k <= n)")
    p.add_argument("--max-new-tokens", type=int, help="default: --config's rollout, else 1024")
    p.add_argument("--temperature", type=float, help="default: --config's rollout, else 0.6")
    p.add_argument("--top-p", type=float, help="default: --config's rollout, else 0.95")
    p.add_argument("--max-problems", type=int, default=0, help="first N problems (0: all)")
    p.add_argument("--max-prompt-len", type=int, default=1024)
    p.add_argument(
        "--option", action="append", default=[], metavar="KEY=VALUE",
        help="one of the task's own options (dataset.options), e.g. max_operand=9 for arith",
    )  # fmt: skip
    p.add_argument(
        "--backend", help="inference server to start: embedded, sglang or vllm (default: "
        "--config's inference.backend, else embedded)",
    )  # fmt: skip
    p.add_argument("--server-url", help="a running server of --backend's kind (default: start one)")
    p.add_argument(
        "--api-key", default=os.environ.get(API_KEY_ENV) or None,
        help=f"the --server-url server's API key (default: ${API_KEY_ENV}); a run's servers take "
        "the key `python -m areal.rollout.auth EXP_DIR` prints",
    )  # fmt: skip
    p.add_argument("--num-threads", type=int, default=1, help="threads of the started (CPU) server")
    p.add_argument("--n-workers", type=int, default=2, help="grading processes")
    p.add_argument("--timeout-s", type=float, default=10.0, help="time limit of one grading")
    p.add_argument("--code-time-limit-s", type=float, help="default: --config's reward, else 6")
    p.add_argument("--max-concurrent", type=int, default=16, help="problems in flight")
    p.add_argument("--startup-timeout-s", type=float, default=300.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", help="result JSON (default: eval_<data stem>.json here)")
    args = p.parse_args(argv)
    run = Path(args.model)
    args.run_dir = (
        run if (run / "config.yaml").is_file() and (run / "checkpoints").is_dir() else None
    )
    if args.run_dir is not None and not (args.data or args.task or args.config):
        args.config = str(run / "config.yaml")  # the run's task, workflow and sampling
    if not (args.data or args.task or args.config):
        p.error("--data is required (or --task naming a task made in code, e.g. arith)")
    if args.n_samples < 1 or (args.max_new_tokens or 1) < 1 or not (args.temperature or 1) > 0:
        p.error("--n-samples and --max-new-tokens must be >= 1 and --temperature > 0")
    args.ks = sorted({int(k) for k in args.k.split(",") if k.strip()})
    return args


def resolve_settings(args: argparse.Namespace) -> None:
    """--config's sections, overridden by the flags given; ConfigError for a mistake."""
    base = load_config(args.config) if args.config else None
    args.backend = args.backend or (base.inference.backend if base else "embedded")
    rollout = base.rollout if base else RolloutConfig()
    dataset = base.dataset if base else DatasetConfig()
    if base and not args.data and not args.task:
        args.task, args.data = base.dataset.type, base.dataset.path
    args.task = args.task or infer_task(args.data)
    options = dict(dataset.options) if args.task == dataset.type else {}
    for kv in args.option:
        key, sep, value = kv.partition("=")
        if not sep:
            raise ConfigError(f"--option {kv!r}: write KEY=VALUE, e.g. max_operand=9")
        options[key.strip()] = yaml.safe_load(value)
    from areal.tasks import load_task

    if load_task(args.task).needs_path and not args.data:
        raise ConfigError(f"task {args.task!r} reads its problems from a file: pass --data")
    # The task's options are checked here, against the task evaluated.
    args.dataset = dataclasses.replace(
        dataset, type=args.task, path=args.data or "", options=options
    )
    sampling = {k: getattr(rollout, k) if base else v for k, v in DEFAULT_SAMPLING.items()}
    for key in sampling:
        if getattr(args, key) is not None:
            sampling[key] = getattr(args, key)
    args.sampling = sampling
    args.rollout = dataclasses.replace(
        rollout, workflow=args.workflow or rollout.workflow, **sampling
    )
    reward = base.reward if base else RewardConfig()
    args.reward = dataclasses.replace(
        reward,
        n_workers=args.n_workers,
        timeout_s=args.timeout_s,
        correct=1.0,
        wrong=0.0,
        code_time_limit_s=args.code_time_limit_s or reward.code_time_limit_s,
    )
    # The server's settings (the backend's command line reads them): --config's inference
    # section and model dtype, serving --model with this evaluation's lengths, seed, threads.
    args.cfg = load_config(
        args.config,
        [
            f"model.path={args.model}", f"inference.backend={args.backend}",
            f"inference.num_threads={args.num_threads}", f"seed={args.seed}",
            f"rollout.max_new_tokens={sampling['max_new_tokens']}",
            f"dataset.max_prompt_len={args.max_prompt_len}", "stats.events=false",
            "resume=false",
        ],
    )  # fmt: skip
    from areal.workflow import resolve

    try:  # a misspelt workflow: say so before a server starts
        resolve(args.rollout.workflow)
    except ValueError as e:
        raise ConfigError(str(e)) from e


def run_model(run: Path) -> Path:
    """The model a run trained: its latest checkpoint's model/ (what areal.export writes)."""
    from areal.export import find_weights
    from areal.weights import is_adapter_dir

    try:
        model = find_weights(run)
    except ValueError as e:
        raise ConfigError(f"--model {run}: {e}") from None
    if is_adapter_dir(model):
        raise ConfigError(
            f"--model {run} is a LoRA run: its checkpoint holds adapters. Merge them first "
            f"(python -m areal.export {run} --out DIR), then evaluate --model DIR"
        )
    return model


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if args.run_dir is not None:
            args.model = str(run_model(args.run_dir))
            print(f"areal.eval: evaluating {args.model} (the run's latest checkpoint)")
        if not (Path(args.model) / "config.json").is_file():
            raise ConfigError(f"--model {args.model!r} holds no config.json: give an HF model dir")
        resolve_settings(args)
        from areal.data.dataset import tokenize_rows
        from areal.tokenizer import load_tokenizer

        args.tokenizer = load_tokenizer(args.model)
        rows = tokenize_rows(load_problems(args), args.tokenizer, args.max_prompt_len)
    except (ConfigError, ValueError) as e:
        print(f"areal.eval: error: {e}", file=sys.stderr)
        return 2
    output = Path(args.output or f"eval_{Path(args.data or args.task).stem}.json")
    args.server_proc = args.server_log = None
    url = args.server_url
    if url is None:
        args.server_log = output.with_suffix(".server.log")
        try:
            args.server_proc, url = start_server(args, args.server_log)
        except ConfigError as e:
            print(f"areal.eval: error: {e}", file=sys.stderr)
            return 2
        print(f"areal.eval: started the {args.backend} server at {url} (log {args.server_log})")
    t0 = time.time()
    try:
        correct = asyncio.run(sample_and_grade(args, rows, url))
    except (RuntimeError, TimeoutError, ConnectionError) as e:  # the server failed
        print(f"areal.eval: error: {e}", file=sys.stderr)
        return 1
    finally:
        if args.server_proc is not None:
            args.server_proc.terminate()
            args.server_proc.wait(timeout=30)
    scores = summarise(correct, args.ks)
    result = {
        "model": args.model,
        "data": args.data,
        "task": args.task,
        "n_problems": len(rows),
        "n_samples": args.n_samples,
        "backend": args.backend,
        "workflow": args.rollout.workflow,
        "sampling": args.sampling,
        "scores": scores,
        "reward_counts": args.reward_counts,
        "episode_counts": args.episode_counts,
        "workflow_stats": args.workflow_stats,
        "per_problem_correct": [sum(c) for c in correct],
        "seconds": round(time.time() - t0, 2),
    }
    output.write_text(json.dumps(result, indent=1) + "\n")
    print(f"{'metric':<10} {'value':>8}")
    for name, value in scores.items():
        print(f"{name:<10} {value:>8.4f}")
    print(
        f"{len(rows)} {args.task} problems x {args.n_samples} samples in {result['seconds']} s; "
        f"grading timeouts {args.reward_counts['timeouts']}, errors {args.reward_counts['errors']}"
        + "".join(f"; episodes {k} {v}" for k, v in args.episode_counts.items() if v)
    )
    print(f"areal.eval: wrote {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
