"""The whole system against TRL's synchronous GRPOTrainer, same model, data and geometry,
and both against the machine's limit.

    pip install -c constraints.txt trl     # the repository's constraints.txt keeps the CPU torch
    python benchmarks/vs_trl.py [--task arith|math] [--geometries 145k:32:8:8,4m:128:8:8,...]
        [--steps 60] [--repeats 1] [--etas 0,4] [--fixed-split] [--limit-steps 3] [--skip-trl]
        [--dtype float32]

A geometry is shape:new:prompts:group: the model shape of benchmarks/engine.py (145k:
hidden 64, 2 layers; 4m: hidden 256, intermediate 1024, 4 layers), the new tokens per
answer, prompts per step and samples per prompt. The default is the three of issue 28.
Both sides train the same Qwen2 (the tiny tokenizer) on the same prompts, graded the same way,
one optimizer step per step (areal: ppo.n_minibatches=1,
trainer.batch_size=prompts, rollout.group_size=group; TRL: per_device_train_batch_size=
prompts x group, num_generations=group), temperature 1, no KL term, learning rate 1e-3.
The task:
  arith (the default): the tiny task's sums ("3+4="), a random-initialised model, the tiny
      task's regex grader on both sides;
  math: the mission's task, sums asked in words inside the math template ("What is 3 + 4?
      Let's think step by step and output the final answer within \\boxed{}.", chat
      template around it), a model first warmed up (WARMUP_STEPS supervised steps of the math
      task's warm-up) to answer in \\boxed{}, graded by math-verify on both sides: areal
      dataset.type=math through its reward service; TRL its own trl.rewards.accuracy_reward
      (math-verify), scaled to areal's +5/-5.
With --dtype bfloat16 both compute in bfloat16: areal model.dtype=bfloat16 (servers in
bfloat16, the trainer under autocast with float32 weights), TRL bf16=True (autocast), and
the limit with the engine and trainer in the same dtype.

Effective training throughput, counted the same way for all: completion tokens that enter
the update per second of wall time, over the steps after warm-up (the first fifth left
out; tiny_run.effective_throughput). TRL: its own per-step log (completions/mean_length
x prompts x group) and wall clock at each step's end; areal: metrics.jsonl
(train/n_tokens, time), at each eta of --etas (and with --fixed-split, each again with
launcher.lend_idle_cores=false: no core lent). Each variant is its own process on the same
cores (TRL with torch's default threads; areal's roles split the cores,
inference.num_threads / trainer.num_threads = 0, and lend them to each other while they
wait, launcher.lend_idle_cores).

The machine's limit: on C cores (C = the process's CPU affinity) a step cannot take less
than (core-seconds of generation + core-seconds of training) / C. Both are measured in a
process of their own with torch on one thread: generation by areal's engine alone
(areal.rollout.engine.DecodeEngine in process, as the server builds it), the step's
prompts x group requests made from the run's task prompts and tokenizer (chat template),
temperature 1, max_new_tokens = the geometry's new tokens, all submitted at once; training
by areal's trainer alone on that batch: make_backend and train_step with the trainer's own
arguments for the run's config (trainer/worker.py's _step_args; with one minibatch and no
behaviour-weight cap the update's forward gives the proximal log-probs, so there is no
separate proximal pass), mb_spec max_tokens_per_mb=8192. Core-seconds are the process's
CPU time; medians of --limit-steps steps after one warm-up. Limit tok/s = completion
tokens per step / ((gen + train core-seconds) / C).

Prints a line per repeat (the variants interleaved, so all see the same machine), then the
table: TRL, areal at each eta and the limit in tok/s, the fraction of the limit each
reaches, and the ratios areal/TRL; with --repeats > 1, medians. --skip-trl measures areal
and the limit without TRL installed.

TRL is a benchmark dependency only: nothing in areal imports it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from engine import SHAPES  # the same model shapes
from tiny_run import TINY, effective_throughput, train_tiny

from areal.cores import node_cores

LR, MAX_OPERAND = 1e-3, 5
WARMUP_STEPS = 200  # the math model's: it boxes its answers (a random one never does)
TASKS = ("arith", "math")
GEOMETRIES = "145k:32:8:8,4m:128:8:8,4m:64:16:4"


@dataclass(frozen=True)
class Geometry:
    shape: str
    new: int  # new tokens per answer
    prompts: int  # prompts per step
    group: int  # samples per prompt

    @classmethod
    def parse(cls, text: str) -> Geometry:
        shape, new, prompts, group = text.split(":")
        if shape not in SHAPES:
            raise ValueError(f"unknown shape {shape!r} in {text!r}: one of {', '.join(SHAPES)}")
        return cls(shape, int(new), int(prompts), int(group))

    def __str__(self) -> str:
        return f"{self.shape}:{self.new}:{self.prompts}:{self.group}"


def make_model(shape: str, task: str, out: Path) -> Path:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from areal.models.tiny import _warm_up, build_tokenizer

    tok = build_tokenizer(0)
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=len(tok), max_position_embeddings=1024, tie_word_embeddings=True,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None,
        **SHAPES[shape][0],
    )  # fmt: skip
    model = Qwen2ForCausalLM(config)
    if task == "math":
        _warm_up(model, tok, WARMUP_STEPS, "math", None, seed=0)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def math_records(path: Path, n: int) -> Path:
    """The math variant's data, one file for both sides."""
    from areal.tasks.math import sum_records

    path.write_text("".join(json.dumps(r) + "\n" for r in sum_records(n, seed=1)))
    return path


def areal_overrides(model: Path | str, geo: Geometry, eta: int, dtype: str, data: str) -> list[str]:
    """`data`: the math records' file ("": the arith task)."""
    task = [f"dataset.options.max_operand={MAX_OPERAND}"]
    if data:
        task = ["dataset.type=math", f"dataset.path={data}"]
    return [
        f"model.path={model}", f"model.dtype={dtype}", f"max_staleness={eta}",
        f"rollout.max_new_tokens={geo.new}", f"rollout.group_size={geo.group}",
        f"trainer.batch_size={geo.prompts}", *task, "ppo.n_minibatches=1", f"trainer.lr={LR}",
        "trainer.warmup_steps_ratio=0", "trainer.mb_spec.max_tokens_per_mb=8192",
    ]  # fmt: skip


FIXED_SPLIT = ["launcher.lend_idle_cores=false"]


def run_areal(
    model: Path,
    geo: Geometry,
    eta: int,
    steps: int,
    root: str,
    name: str,
    extra: list[str],
    dtype: str,
    data: str,
) -> float:
    overrides = areal_overrides(model, geo, eta, dtype, data) + extra
    return effective_throughput(train_tiny(root, name, steps, overrides))


def worker(*args: str) -> str:
    """`python vs_trl.py --WHAT-worker ARGS...` in its own process; its last line of output."""
    cmd = [sys.executable, __file__, *args]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return proc.stdout.strip().splitlines()[-1]


def run_trl(model: Path, geo: Geometry, steps: int, dtype: str, data: str, out: str) -> float:
    return float(worker("--trl-worker", str(model), str(geo), str(steps), dtype, data, out))


def run_limit(model: Path, geo: Geometry, steps: int, dtype: str, data: str) -> dict[str, float]:
    """{"gen_s", "train_s" (core-seconds), "tokens"} per step, medians."""
    return json.loads(worker("--limit-worker", str(model), str(geo), str(steps), dtype, data))


def trl_worker(model: str, geo: Geometry, steps: int, dtype: str, data: str, out: str) -> None:
    # This script's folder leaves the import path: its vllm.py would pass for vLLM in
    # TRL's availability check (and fail it: no version).
    here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != here]
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from areal.tasks.arith import is_correct, make_problems

    if data:  # the math task: its template, TRL's own math-verify reward
        from trl.rewards import accuracy_reward

        from areal.tasks.math import from_record

        records = [json.loads(line) for line in Path(data).read_text().splitlines()]
        rows = [from_record(r) for r in records]

        def reward(completions, answer, **_):
            right = accuracy_reward(completions, answer)
            return [5.0 if r == 1.0 else -5.0 for r in right]
    else:
        rows = make_problems(geo.prompts * (steps + 2), MAX_OPERAND, seed=1)

        def reward(completions, answer, **_):
            pairs = zip(completions, answer, strict=True)
            return [5.0 if is_correct(c[0]["content"], a) else -5.0 for c, a in pairs]

    dataset = Dataset.from_list(
        [{"prompt": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]}
         for r in rows]
    )  # fmt: skip

    marks: list[tuple[float, float]] = []

    class Clock(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "completions/mean_length" in logs:
                marks.append((time.perf_counter(), logs["completions/mean_length"]))

    batch = geo.prompts * geo.group
    config = GRPOConfig(
        output_dir=out, per_device_train_batch_size=batch, num_generations=geo.group,
        max_completion_length=geo.new, learning_rate=LR, beta=0.0, temperature=1.0,
        logging_steps=1, max_steps=steps, report_to="none", save_strategy="no", use_cpu=True,
        lr_scheduler_type="constant", warmup_steps=0, disable_tqdm=True, seed=1,
        bf16=dtype == "bfloat16",
    )  # fmt: skip
    trainer = GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(model),
        processing_class=AutoTokenizer.from_pretrained(model),
        reward_funcs=reward, args=config, train_dataset=dataset, callbacks=[Clock()],
    )  # fmt: skip
    trainer.train()
    steps = [{"time": t, "train/n_tokens": length * batch} for t, length in marks]
    print(effective_throughput(steps))


def limit_worker(model: str, geo: Geometry, steps: int, dtype: str, data: str) -> None:
    """One thread: the engine generates a step's batch, the trainer trains on it; prints
    the medians of --limit-steps steps after one warm-up, as JSON."""
    import torch
    from transformers import AutoTokenizer

    from areal.config import load_config
    from areal.data.dataset import load_rows, tokenize_rows
    from areal.rollout.engine import DecodeEngine, SamplingParams
    from areal.tasks import load_task
    from areal.trainer.factory import make_backend
    from areal.trainer.parallel import DataParallel
    from areal.trainer.step import train_step
    from areal.trainer.worker import _step_args
    from areal.trajectory import Trajectory

    torch.set_num_threads(1)
    overrides = [*areal_overrides(model, geo, 0, dtype, data), f"total_train_steps={steps + 1}"]
    cfg = load_config(str(TINY), overrides)
    torch.manual_seed(cfg.seed)
    tokenizer = AutoTokenizer.from_pretrained(model)
    rows = tokenize_rows(load_rows(cfg.dataset, cfg.seed), tokenizer, cfg.dataset.max_prompt_len)
    task = load_task(cfg.dataset.type)
    inf = cfg.inference
    engine = DecodeEngine.from_dir(
        model, max_batch_size=inf.max_batch_size, max_total_tokens=inf.max_total_tokens,
        seed=cfg.seed, num_threads=1, dtype=getattr(torch, dtype),
    )  # fmt: skip
    backend, dp = make_backend(cfg, model, DataParallel())
    params = SamplingParams(max_new_tokens=geo.new, temperature=cfg.rollout.temperature)
    gen_s, train_s, tokens = [], [], []
    for step in range(steps + 1):  # step 0: warm-up
        batch = rows[step * geo.prompts : (step + 1) * geo.prompts]
        c0 = time.process_time()
        futures = [
            (p, row, engine.submit(f"{step}-{p}-{g}", row["prompt_ids"], params))
            for p, row in enumerate(batch)
            for g in range(geo.group)
        ]
        results = [(p, row, f.result(timeout=600)) for p, row, f in futures]
        c1 = time.process_time()
        trajs = []
        for p, row, r in results:
            text = tokenizer.decode(r.output_ids, skip_special_tokens=True)
            correct = task.is_correct(text, row["answer"])
            trajs.append(
                Trajectory(
                    group_id=step * geo.prompts + p, prompt_ids=r.prompt_ids,
                    output_ids=r.output_ids, logprobs=r.logprobs,
                    versions=[r.weight_version] * len(r.output_ids),
                    finish_reason=r.finish_reason["type"],
                    reward=cfg.reward.correct if correct else cfg.reward.wrong,
                )
            )  # fmt: skip
        c2 = time.process_time()
        train_step(backend, trajs, dp=dp, **_step_args(cfg, step))
        c3 = time.process_time()
        if step:
            gen_s.append(c1 - c0)
            train_s.append(c3 - c2)
            tokens.append(sum(t.n_generated for t in trajs))
    engine.shutdown()
    result = {"gen_s": gen_s, "train_s": train_s, "tokens": tokens}
    print(json.dumps({k: statistics.median(v) for k, v in result.items()}))


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] in ("--trl-worker", "--limit-worker"):
        model, geo, steps, dtype, data, *rest = sys.argv[2:]
        geo = Geometry.parse(geo)
        if sys.argv[1] == "--trl-worker":
            trl_worker(model, geo, int(steps), dtype, data, rest[0])
        else:
            limit_worker(model, geo, int(steps), dtype, data)
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--task", choices=TASKS, default="arith")
    parser.add_argument(
        "--geometries", default=GEOMETRIES, help="shape:new:prompts:group, comma-separated"
    )
    # An eta>0 run starts with every batch in flight at once (each update then interrupts a
    # full batch) and settles after about 10 steps into the server keeping ahead: 60 steps
    # measure the steady state, not the start.
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--etas", default="0,4", help="areal's max_staleness, comma-separated")
    parser.add_argument("--limit-steps", type=int, default=3, help="after one warm-up step")
    parser.add_argument("--skip-trl", action="store_true", help="areal and the limit only")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument(
        "--fixed-split", action="store_true", help="each eta also with lend_idle_cores=false"
    )
    args = parser.parse_args()
    geometries = [Geometry.parse(g) for g in args.geometries.split(",")]
    # (column, eta, extra overrides) of each areal run
    variants = [(f"eta={e}", int(e), []) for e in args.etas.split(",")]
    if args.fixed_split:
        variants += [(f"{name} fixed", eta, FIXED_SPLIT) for name, eta, _ in variants]
    cores = node_cores()
    rows = []
    with tempfile.TemporaryDirectory() as root:
        data = str(math_records(Path(root) / "math.jsonl", 4096)) if args.task == "math" else ""
        models: dict[str, Path] = {}
        for geo in geometries:
            if geo.shape not in models:
                models[geo.shape] = make_model(geo.shape, args.task, Path(root) / geo.shape)
            model = models[geo.shape]
            res: dict[str, list[float]] = {"trl": [], **{v[0]: [] for v in variants}, "limit": []}
            for r in range(args.repeats):  # interleaved: all see the same machine
                tag = f"{geo.shape}-{geo.new}-{geo.prompts}x{geo.group}-{r}"
                if not args.skip_trl:
                    trl = run_trl(model, geo, args.steps, args.dtype, data, f"{root}/trl-{tag}")
                    res["trl"].append(trl)
                for name, eta, extra in variants:
                    res[name].append(
                        run_areal(
                            model,
                            geo,
                            eta,
                            args.steps,
                            root,
                            f"{tag}-{name}",
                            extra,
                            args.dtype,
                            data,
                        )
                    )
                lim = run_limit(model, geo, args.limit_steps, args.dtype, data)
                res["limit"].append(lim["tokens"] / ((lim["gen_s"] + lim["train_s"]) / cores))
                print(
                    f"  {geo} repeat {r}: "
                    + ", ".join(f"{k} {v[-1]:.0f} tok/s" for k, v in res.items() if v)
                    + f" (one thread: generation {lim['gen_s']:.2f} + training "
                    f"{lim['train_s']:.2f} core-s for {lim['tokens']:.0f} tokens, {cores} cores)",
                    flush=True,
                )
            rows.append((geo, {k: statistics.median(v) if v else None for k, v in res.items()}))
    print(f"task {args.task}")
    print_table(rows, [name for name, _, _ in variants], cores)


def print_table(rows: list, names: list[str], cores: int) -> None:
    """tok/s of TRL, areal's variants and the limit; fractions of the limit; areal/TRL."""
    cols = [("TRL tok/s", "{:.0f}", lambda m: m["trl"])]
    cols += [(f"areal {n}", "{:.0f}", lambda m, n=n: m[n]) for n in names]
    cols += [("limit tok/s", "{:.0f}", lambda m: m["limit"])]
    cols += [("TRL/limit", "{:.2f}", lambda m: m["trl"] and m["trl"] / m["limit"])]
    cols += [(f"{n}/limit", "{:.2f}", lambda m, n=n: m[n] / m["limit"]) for n in names]
    cols += [(f"{n}/TRL", "{:.2f}x", lambda m, n=n: m["trl"] and m[n] / m["trl"]) for n in names]
    print(f"{cores} cores; limit = completion tokens / ((generation + training core-s) / cores)")
    print(f"{'geometry':<14}" + "".join(f" {name:>12}" for name, _, _ in cols))
    for geo, m in rows:
        cells = ["-" if (v := get(m)) is None else spec.format(v) for _, spec, get in cols]
        print(f"{str(geo):<14}" + "".join(f" {c:>12}" for c in cells))


if __name__ == "__main__":
    main()
