"""The whole system against TRL's synchronous GRPOTrainer, same model, data and geometry,
and both against the machine's limit.

    pip install -c constraints.txt trl     # the repository's constraints.txt keeps the CPU torch
    python benchmarks/vs_trl.py [--task arith|math|long] [--geometries 145k:32:8:8,4m:128:8:8,...]
        [--steps 60] [--repeats 1] [--max-staleness 0,4] [--fixed-split] [--limit-steps 3]
        [--skip-trl] [--trl-threads 0] [--dtype float32]

A geometry is shape:new:prompts:group: the model shape of benchmarks/engine.py (145k:
hidden 64, 2 layers; 4m: hidden 256, intermediate 1024, 4 layers), the new tokens per
answer, prompts per step and samples per prompt. The default is the three of issue 28.
Both sides train the same Qwen2 (the tiny tokenizer) on the same prompts, graded the same way,
one optimizer step per step (areal: ppo.n_minibatches=1,
trainer.batch_size=prompts, rollout.group_size=group; TRL: per_device_train_batch_size=
prompts x group, num_generations=group), temperature 1, no KL term, learning rate LR.
The task:
  arith (the default): the tiny task's sums ("3+4="), a random-initialised model, the tiny
      task's regex grader on both sides;
  math: the mission's task, sums asked in words inside the math template ("What is 3 + 4?
      Let's think step by step and output the final answer within \\boxed{}.", chat
      template around it), a model first warmed up (WARMUP_STEPS supervised steps of the math
      task's warm-up) to answer in \\boxed{}, graded by math-verify on both sides: areal
      dataset.type=math through its reward service; TRL its own trl.rewards.accuracy_reward
      (math-verify), scaled to areal's +5/-5.
  long: the math task on a random-initialised model (no warm-up): nothing is boxed and EOS
      is rare, so answers run to the full length and generation dominates (issue 59's
      regime; every reward -5 on both sides).
With --dtype bfloat16 both compute in bfloat16: areal model.dtype=bfloat16 (servers in
bfloat16, the trainer under autocast with float32 weights), TRL bf16=True (autocast), and
the limit with the engine and trainer in the same dtype.

Effective training throughput, counted the same way for all: completion tokens that enter
the update per second of wall time, over the steps after warm-up (the first fifth left out;
tiny_run.effective_throughput). TRL: its own per-step log (completions/mean_length x prompts
x group) and wall clock at each step's end; areal: metrics.jsonl (train/n_tokens, time), at
each value of --max-staleness (areal's max_staleness, the paper's eta; and with
--fixed-split, each again with launcher.lend_idle_cores=false: no core lent). Each variant
is its own process on the same cores (TRL with torch's default threads; areal's roles split
the cores, inference.num_threads / trainer.num_threads = 0, and lend them to each other
while they wait, launcher.lend_idle_cores).

The machine's limit, for each run at the answer lengths it trained on (RL changes them: on
the math task at lr 1e-3 answers grow from ~25 tokens to the 128 allowed within ten steps):
on C cores (C = the process's CPU affinity) a step cannot take less than (core-seconds of
generation + core-seconds of training) / C. Both are measured in a process of their own
with torch on one thread, on --limit-steps of the run's steps (evenly spread over the
measured ones, after one warm-up step): generation by areal's engine alone
(areal.rollout.engine.DecodeEngine in process, as the server builds it), the step's
requests made from the run's task prompts and tokenizer (chat template), temperature 1,
each generating exactly its answer's length in the run (ignore_eos; TRL logs a step's mean
length only, so its answers are all that long), all submitted at once; training by areal's
trainer alone on that batch: make_backend and train_step with the trainer's own arguments
for the run's config (trainer/worker.py's StepPlan.prepare_args; with one minibatch and no
behaviour-weight cap the update's forward gives the proximal log-probs, so there is no
separate proximal pass), mb_spec max_tokens_per_mb=8192. Core-seconds are the process's
CPU time; medians over those steps. Limit tok/s = completion tokens per step / ((gen +
train core-seconds) / C).

Prints a line per repeat (the variants interleaved, so all see the same machine), then the
table: TRL and areal at each max_staleness (columns ms=N) in tok/s, the fraction of its own
limit each reaches, and the ratios areal/TRL; with --repeats > 1, medians. --skip-trl
measures areal and the limit without TRL installed.

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

import yaml
from engine import SHAPES  # the same model shapes
from tiny_run import TINY, effective_throughput, train_tiny

from areal.cores import node_cores

MAX_OPERAND = 5
# Learning rates: the tiny task's; on the math task's longer answers 1e-3 drives the warmed-up
# policy within ten steps to 128-token answers without a box (reward -5 throughout).
LR = {"arith": 1e-3, "math": 1e-4}


def learning_rate(data: str) -> float:
    """`data`: the math records' file ("": the arith task)."""
    return LR["math" if data else "arith"]


WARMUP_STEPS = 200  # the math model's: it boxes its answers (a random one never does)
TASKS = ("arith", "math", "long")
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


def areal_overrides(
    model: Path | str, geo: Geometry, max_staleness: int, dtype: str, data: str
) -> list[str]:
    """`data`: the math records' file ("": the arith task)."""
    task = [f"dataset.options.max_operand={MAX_OPERAND}"]
    if data:
        task = ["dataset.type=math", f"dataset.path={data}"]
    return [
        f"model.path={model}", f"model.dtype={dtype}",
        f"max_staleness={max_staleness}",
        f"rollout.max_new_tokens={geo.new}", f"rollout.group_size={geo.group}",
        f"trainer.batch_size={geo.prompts}", *task, "ppo.n_minibatches=1",
        f"trainer.lr={learning_rate(data)}",
        "trainer.warmup_steps_ratio=0", "trainer.mb_spec.max_tokens_per_mb=8192",
    ]  # fmt: skip


FIXED_SPLIT = ["launcher.lend_idle_cores=false"]


def measured_steps(lengths: list, n: int) -> list:
    """n + 1 of a run's steps (the first a warm-up), evenly spread over the measured ones
    (effective_throughput leaves out the first fifth)."""
    kept = lengths[len(lengths) // 5 :]
    return [kept[round(i * (len(kept) - 1) / n)] for i in range(n + 1)]


def run_areal(
    model: Path,
    geo: Geometry,
    max_staleness: int,
    steps: int,
    root: str,
    name: str,
    extra: list[str],
    dtype: str,
    data: str,
) -> tuple[float, list[list[int]]]:
    """Effective throughput and every step's answer lengths."""
    overrides = areal_overrides(model, geo, max_staleness, dtype, data) + extra
    tok_s = effective_throughput(train_tiny(root, name, steps, overrides))
    run = Path(root) / yaml.safe_load(TINY.read_text())["experiment_name"] / name
    batches = [json.loads(line) for line in (run / "batches.jsonl").read_text().splitlines()]
    return tok_s, [b["output_len"] for b in batches]


def worker(*args: str) -> str:
    """`python vs_trl.py --WHAT-worker ARGS...` in its own process; its last line of output."""
    cmd = [sys.executable, __file__, *args]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return proc.stdout.strip().splitlines()[-1]


def run_trl(
    model: Path, geo: Geometry, steps: int, dtype: str, data: str, out: str, threads: int
) -> tuple[float, list[list[int]], float]:
    """Effective throughput, every step's answer lengths (each its step's mean) and the
    process CPU seconds of a measured step (median)."""
    found = json.loads(
        worker("--trl-worker", str(model), str(geo), str(steps), dtype, data, out, str(threads))
    )
    batch = geo.prompts * geo.group
    lengths = [[round(mean)] * batch for mean in found["mean_lengths"]]
    return found["tok_s"], lengths, found["core_s"]


def run_limit(
    model: Path, geo: Geometry, lengths: list[list[int]], dtype: str, data: str, out: str
) -> dict[str, float]:
    """{"gen_s", "train_s" (core-seconds), "tokens"} per step at these steps' answer
    lengths (the first a warm-up), medians."""
    Path(out).write_text(json.dumps(lengths))
    return json.loads(worker("--limit-worker", str(model), str(geo), out, dtype, data))


def limit_tok_s(lim: dict[str, float], cores: int) -> float:
    return lim["tokens"] / ((lim["gen_s"] + lim["train_s"]) / cores)


def trl_worker(
    model: str, geo: Geometry, steps: int, dtype: str, data: str, out: str, threads: int
) -> None:
    # This script's folder leaves the import path: its vllm.py would pass for vLLM in
    # TRL's availability check (and fail it: no version).
    here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != here]
    import torch
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

    if threads:
        torch.set_num_threads(threads)
    marks: list[tuple[float, float, float]] = []  # (wall, process CPU, mean answer length)

    class Clock(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "completions/mean_length" in logs:
                now = (time.perf_counter(), time.process_time())
                marks.append((*now, logs["completions/mean_length"]))

    batch = geo.prompts * geo.group
    config = GRPOConfig(
        output_dir=out, per_device_train_batch_size=batch, num_generations=geo.group,
        max_completion_length=geo.new, learning_rate=learning_rate(data), beta=0.0,
        temperature=1.0,
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
    steps = [{"time": t, "train/n_tokens": length * batch} for t, _, length in marks]
    kept = marks[len(marks) // 5 :]  # effective_throughput's steps: the CPU they cost
    cpu = statistics.median(b[1] - a[1] for a, b in zip(kept, kept[1:], strict=False))
    print(json.dumps({"tok_s": effective_throughput(steps), "core_s": cpu,
                      "mean_lengths": [m for _, _, m in marks]}))  # fmt: skip


def limit_worker(model: str, geo: Geometry, lengths_file: str, dtype: str, data: str) -> None:
    """One thread: the engine generates a step's batch at the given answer lengths, the
    trainer trains on it; prints the medians of the steps after the first, as JSON."""
    import torch
    from transformers import AutoTokenizer

    from areal.config import load_config
    from areal.data.dataset import load_rows, tokenize_rows
    from areal.rollout.engine import DecodeEngine, SamplingParams
    from areal.tasks import load_task
    from areal.trainer.parallel import DataParallel
    from areal.trainer.step import train_step
    from areal.trajectory import Trajectory
    from areal.worker import make_backend, step_plan

    torch.set_num_threads(1)
    lengths = json.loads(Path(lengths_file).read_text())
    overrides = [*areal_overrides(model, geo, 0, dtype, data), f"total_train_steps={len(lengths)}"]
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
    gen_s, train_s, tokens = [], [], []
    for step, answers in enumerate(lengths):  # step 0: warm-up
        c0 = time.process_time()
        futures = []
        for j, n in enumerate(answers):
            p = j // geo.group
            row = rows[(step * geo.prompts + p) % len(rows)]
            params = SamplingParams(
                max_new_tokens=max(1, n), temperature=cfg.rollout.temperature, ignore_eos=True
            )
            futures.append((p, row, engine.submit(f"{step}-{j}", row["prompt_ids"], params)))
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
        train_step(backend, trajs, dp=dp, **step_plan(cfg).prepare_args(step))
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
            trl_worker(model, geo, int(steps), dtype, data, rest[0], int(rest[1]))
        else:
            limit_worker(model, geo, steps, dtype, data)  # steps: the lengths' file
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--task", choices=TASKS, default="arith")
    parser.add_argument(
        "--geometries", default=GEOMETRIES, help="shape:new:prompts:group, comma-separated"
    )
    # A max_staleness>0 run starts with every batch in flight at once (each update then
    # interrupts a full batch) and settles after about 10 steps into the server keeping ahead:
    # 60 steps measure the steady state, not the start.
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument(
        "--max-staleness", default="0,4", help="areal's max_staleness, comma-separated"
    )
    parser.add_argument("--limit-steps", type=int, default=3, help="after one warm-up step")
    parser.add_argument("--skip-trl", action="store_true", help="areal and the limit only")
    parser.add_argument(
        "--trl-threads", type=int, default=0,
        help="torch threads of TRL's process (0: torch's default, every core); 1 measures "
        "its single-thread cost, to set against areal's (the limit's)",
    )  # fmt: skip
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument(
        "--fixed-split",
        action="store_true",
        help="each max_staleness also with lend_idle_cores=false",
    )
    args = parser.parse_args()
    geometries = [Geometry.parse(g) for g in args.geometries.split(",")]
    # (column, max_staleness, extra overrides) of each areal run; the columns say ms=N, as
    # "max_staleness=N" would not fit them (print_table's legend spells it out)
    variants = [(f"ms={b}", int(b), []) for b in args.max_staleness.split(",")]
    if args.fixed_split:
        variants += [(f"{name} fixed", ms, FIXED_SPLIT) for name, ms, _ in variants]
    cores = node_cores()
    rows = []
    with tempfile.TemporaryDirectory() as root:
        math = args.task in ("math", "long")
        data = str(math_records(Path(root) / "math.jsonl", 4096)) if math else ""
        models: dict[str, Path] = {}
        for geo in geometries:
            if geo.shape not in models:
                models[geo.shape] = make_model(geo.shape, args.task, Path(root) / geo.shape)
            model = models[geo.shape]
            sides = ([] if args.skip_trl else ["trl"]) + [name for name, _, _ in variants]
            res: dict[str, list[float]] = {k: [] for s in sides for k in (s, f"{s}/limit")}
            if not args.skip_trl:
                res["trl/cpu"] = []  # TRL's CPU a step / areal's one-thread core-s
            for r in range(args.repeats):  # interleaved: all see the same machine
                tag = f"{geo.shape}-{geo.new}-{geo.prompts}x{geo.group}-{r}"
                runs, trl_core_s = {}, 0.0
                if not args.skip_trl:
                    tok_s, lengths, trl_core_s = run_trl(
                        model, geo, args.steps, args.dtype, data, f"{root}/{tag}", args.trl_threads
                    )
                    runs["trl"] = (tok_s, lengths)
                for name, max_staleness, extra in variants:
                    runs[name] = run_areal(model, geo, max_staleness, args.steps, root,
                                           f"{tag}-{name}", extra, args.dtype, data)  # fmt: skip
                line = []
                for side, (tok_s, lengths) in runs.items():
                    steps = measured_steps(lengths, args.limit_steps)
                    lim = run_limit(model, geo, steps, args.dtype, data, f"{root}/{tag}.json")
                    res[side].append(tok_s)
                    res[f"{side}/limit"].append(tok_s / limit_tok_s(lim, cores))
                    line.append(
                        f"{side} {tok_s:.0f} tok/s, {res[f'{side}/limit'][-1]:.0%} of its limit "
                        f"(answers {lim['tokens'] / len(steps[0]):.0f} tokens; one thread: "
                        f"generation {lim['gen_s']:.2f} + training {lim['train_s']:.2f} core-s)"
                    )
                    if side == "trl":  # TRL's own CPU a step against areal's at its lengths
                        res["trl/cpu"].append(trl_core_s / (lim["gen_s"] + lim["train_s"]))
                        line[-1] += f"; TRL's process {trl_core_s:.2f} core-s a step"
                print(f"  {geo} repeat {r}: " + "; ".join(line), flush=True)
            rows.append((geo, {k: statistics.median(v) for k, v in res.items()}))
    print(f"task {args.task}, {cores} cores")
    print_table(rows, [name for name, _, _ in variants])


def print_table(rows: list, names: list[str]) -> None:
    """tok/s of TRL and areal's variants; the fraction of its limit each reaches; areal/TRL."""
    trl = "trl" in rows[0][1]
    cols = [("TRL tok/s", "{:.0f}", lambda m: m["trl"])] if trl else []
    cols += [(f"areal {n}", "{:.0f}", lambda m, n=n: m[n]) for n in names]
    cols += [("TRL/limit", "{:.2f}", lambda m: m["trl/limit"])] if trl else []
    cols += [("TRL cpu/ours", "{:.2f}", lambda m: m["trl/cpu"])] if trl else []
    cols += [(f"{n}/limit", "{:.2f}", lambda m, n=n: m[f"{n}/limit"]) for n in names]
    if trl:
        cols += [(f"{n}/TRL", "{:.2f}x", lambda m, n=n: m[n] / m["trl"]) for n in names]
    print("limit = completion tokens / ((generation + training core-s) / cores), per run")
    if trl:
        print(
            "TRL cpu/ours = TRL's process CPU seconds a step / areal's one-thread generation +"
            " training at TRL's lengths (below 1: TRL's step costs fewer core-seconds)"
        )
    print("ms=N: areal at max_staleness N (the paper's eta)")
    print(f"{'geometry':<14}" + "".join(f" {name:>12}" for name, _, _ in cols))
    for geo, m in rows:
        print(f"{str(geo):<14}" + "".join(f" {spec.format(get(m)):>12}" for _, spec, get in cols))


if __name__ == "__main__":
    main()
