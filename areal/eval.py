"""`python -m areal.eval --model DIR --data FILE --n-samples 32`: pass@1 and pass@k.

    data file --prompts--> inference server (embedded subprocess, or --server-url) --n samples-->
    RewardService (same graders, same process pool and time limits as training) --> verdicts
    --> pass@1 (mean over samples, then problems) and pass@k (unbiased estimator) --> table + JSON

pass@k = E_problems[1 - C(n - c, k) / C(n, k)] with n samples of which c are correct
(Chen et al., 2021): unbiased, unlike the fraction of problems solved within k samples.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import secrets
import sys
import time
from pathlib import Path

from areal.config import ConfigError
from areal.data.dataset import SYNTHETIC, synthetic_rows
from areal.rollout.auth import API_KEY_ENV


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


def infer_task(path: str) -> str:
    """math or code, from the first record that has 'tests' or 'answer'."""
    from areal.data.files import BadRecord, read_records

    for _, record in read_records(path):
        if isinstance(record, dict) and not isinstance(record, BadRecord):
            if "tests" in record:
                return "code"
            if "answer" in record:
                return "math"
    raise ConfigError(f"{path}: no record with 'answer' (math) or 'tests' (code); pass --task")


def load_problems(args) -> list[dict]:
    from areal.data.problems import load_file_rows

    if args.task in SYNTHETIC:
        return synthetic_rows(args.task, args.max_problems or 32, args.max_operand, args.seed)
    rows = load_file_rows(args.task, args.data)
    return rows[: args.max_problems] if args.max_problems else rows


async def sample_and_grade(args, rows: list[dict], url: str) -> list[list[bool]]:
    from areal.reward.service import RewardService
    from areal.rollout.client import SGLangClient
    from areal.rollout.launch import wait_for_server

    client = SGLangClient(url, api_key=args.api_key)
    service = RewardService(
        n_workers=args.n_workers,
        timeout_s=args.timeout_s,
        correct=1.0,
        wrong=0.0,
        code_time_limit_s=args.code_time_limit_s,
    )
    sampling = {
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
    }
    done = 0

    async def one(row: dict) -> list[bool]:
        nonlocal done
        outs = await asyncio.gather(
            *(client.generate(row["prompt_ids"], sampling) for _ in range(args.n_samples))
        )
        texts = [args.tokenizer.decode(o.output_ids, skip_special_tokens=True) for o in outs]
        # Graded as soon as this problem's samples are in, while others still generate.
        rewards = await service.grade(row["task"], texts, row["answer"])
        done += 1
        print(f"\r{done}/{len(rows)} problems", end="", file=sys.stderr, flush=True)
        return [r > 0 for r in rewards]

    try:
        await wait_for_server(client, args.startup_timeout_s, args.server_log, args.server_proc)
        limit = asyncio.Semaphore(args.max_concurrent)

        async def bounded(row: dict) -> list[bool]:
            async with limit:
                return await one(row)

        results = await asyncio.gather(*(bounded(r) for r in rows))
        args.reward_counts = await service.stats()
        print(file=sys.stderr)
        return results
    finally:
        await client.close()
        service.close()


def parse_args(argv: list[str] | None):
    p = argparse.ArgumentParser(prog="python -m areal.eval", description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="HF model directory (tokenizer; and served)")
    p.add_argument("--data", help="JSON/JSONL/parquet file of math or code problems")
    p.add_argument("--task", choices=("math", "code", *SYNTHETIC), help="default: from the data")
    p.add_argument("--n-samples", type=int, default=32, help="samples per problem (n)")
    p.add_argument("--k", default="1,4,8,16,32", help="comma-separated k of pass@k (k <= n)")
    p.add_argument("--max-new-tokens", type=int, default=1024)
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--max-problems", type=int, default=0, help="first N problems (0: all)")
    p.add_argument("--max-prompt-len", type=int, default=1024)
    p.add_argument("--max-operand", type=int, default=5, help="arith task only")
    p.add_argument("--server-url", help="a running SGLang or embedded server (default: start one)")
    p.add_argument(
        "--api-key", default=os.environ.get(API_KEY_ENV) or None,
        help=f"the --server-url server's API key (default: ${API_KEY_ENV}); a run's servers take "
        "the key `python -m areal.rollout.auth EXP_DIR` prints",
    )  # fmt: skip
    p.add_argument("--num-threads", type=int, default=1, help="torch threads of the started server")
    p.add_argument("--n-workers", type=int, default=2, help="grading processes")
    p.add_argument("--timeout-s", type=float, default=10.0, help="time limit of one grading")
    p.add_argument("--code-time-limit-s", type=float, default=6.0)
    p.add_argument("--max-concurrent", type=int, default=16, help="problems in flight")
    p.add_argument("--startup-timeout-s", type=float, default=300.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", help="result JSON (default: eval_<data stem>.json here)")
    args = p.parse_args(argv)
    if args.task not in SYNTHETIC and not args.data:
        p.error("--data is required (or --task arith or longtail for a synthetic task)")
    if args.n_samples < 1 or args.max_new_tokens < 1 or not args.temperature > 0:
        p.error("--n-samples and --max-new-tokens must be >= 1 and --temperature > 0")
    args.ks = sorted({int(k) for k in args.k.split(",") if k.strip()})
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if not (Path(args.model) / "config.json").is_file():
            raise ConfigError(f"--model {args.model!r} holds no config.json: give an HF model dir")
        args.task = args.task or infer_task(args.data)
        from transformers import AutoTokenizer

        from areal.data.dataset import tokenize_rows

        args.tokenizer = AutoTokenizer.from_pretrained(args.model)
        rows = tokenize_rows(load_problems(args), args.tokenizer, args.max_prompt_len)
    except (ConfigError, ValueError) as e:
        print(f"areal.eval: error: {e}", file=sys.stderr)
        return 2
    output = Path(args.output or f"eval_{Path(args.data or args.task).stem}.json")
    args.server_proc = args.server_log = None
    url = args.server_url
    if url is None:
        args.server_log = output.with_suffix(".server.log")
        from areal.rollout.launch import start_embedded_server

        args.api_key = secrets.token_hex(16)  # our own server answers only us
        args.server_proc, url = start_embedded_server(
            args.model, args.server_log, "--seed", str(args.seed),
            "--num-threads", str(args.num_threads), api_key=args.api_key,
        )  # fmt: skip
        print(f"areal.eval: started the embedded server at {url} (log {args.server_log})")
    t0 = time.time()
    try:
        correct = asyncio.run(sample_and_grade(args, rows, url))
    except (RuntimeError, TimeoutError) as e:  # the server died or never came up
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
        "sampling": {
            "max_new_tokens": args.max_new_tokens,
            "temperature": args.temperature,
            "top_p": args.top_p,
        },
        "scores": scores,
        "reward_counts": args.reward_counts,
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
    )
    print(f"areal.eval: wrote {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
